"""The node agent's snapshot service: takes snapshots on runtime pods' requests, one per key.

A service of its own beside the cache daemons (composed in node.py), on SNAPSHOT_SOCKET in the
cache's socket directory, with the daemons' peer checks (their ``--allow-uid``/``--allow-gid``) and
the socket's group and mode; the protocol is client.py's. Only this service writes the store (a
snapshot is code), as root; pods read it through a read-only mount.

``snapshot`` requests are answered at once, and the take runs in a thread of its own: "exists"
(already in the store), "started" (a take of this key is running now, perhaps for another pod:
single-flight, so pods starting together take one snapshot), "busy" (a take of another key is
running: one at a time per node, since each costs a preload's CPU; the pod asks again on its next
start), or a refusal naming why (``take.check_key``: the pod runs another image; a malformed
request). A request saying the pod found the existing snapshot ``failed`` (digest, manifest, mapped
files: outcome.BROKEN) has it checked again here, in full, and removed and taken anew when it does
not hold up; so a damaged store heals instead of sending every pod to import. ``restored`` requests
count restores for the status and the LRU.

``rows()`` is what the node agent reports under the WeightCacheNode's status.snapshots[].
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keepwarm_api.sockets import SNAPSHOT_SOCKET
from keepwarm_runtime.cache.protocol import ProtocolError, error_reply, recv_frame, send_frame
from keepwarm_runtime.cache.security import (
    DaemonLock,
    PeerPolicy,
    bind_private,
    check_socket_path,
    peer_cred,
    secure_socket_file,
)
from keepwarm_runtime.snapshot import criu
from keepwarm_runtime.snapshot.client import MAX_REQUEST_BYTES
from keepwarm_runtime.snapshot.key import SnapshotKey
from keepwarm_runtime.snapshot.outcome import BROKEN
from keepwarm_runtime.snapshot.store import Entry, Store, verify_installed
from keepwarm_runtime.snapshot.take import Requester, TakeSettings, check_key, take

log = logging.getLogger(__name__)
FRAME_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 16  # requests handled at once; more are refused busy
MAX_ENV = 512  # import variables in one request
SUSPECT = tuple(reason.value for reason in BROKEN)  # what a pod may say it found wrong (outcome.BROKEN)


@dataclass(frozen=True)
class ServiceSettings:
    socket_dir: Path  # the cache's socket directory (the daemons made it)
    store: Path  # the node's snapshot store
    criu: str  # CRIU binary (path or name on PATH)
    budget: int | None  # bytes the store may hold
    gid: int | None  # the socket directory's group (0660 socket), as the daemons'
    policy: PeerPolicy  # who may ask (the daemons' policy)
    preload_timeout: float = 600.0
    dump_timeout: float = 120.0
    log_level: str = "INFO"


class SnapshotService:
    def __init__(self, settings: ServiceSettings) -> None:
        self.settings = settings
        self.store = Store(settings.store)
        self.path = settings.socket_dir / SNAPSHOT_SOCKET
        self._lock = DaemonLock(self.path)
        self._listener: socket.socket | None = None
        self._taking: str | None = None  # the key digest being taken now
        self._state = threading.Lock()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._stop = threading.Event()
        self.changed = threading.Event()  # set when the store changed (the agent reports it)
        self._take_settings: TakeSettings | None = None
        self._criu_version = ""
        self.threads: list[threading.Thread] = []

    def bind(self) -> None:
        """Check CRIU, prepare the store, take the socket (criu.CriuMissing or OSError: no service)."""
        criu_path = criu.locate(self.settings.criu)
        self._criu_version = criu.version(criu_path)
        self.store.prepare()
        self._take_settings = TakeSettings(
            self.store, criu_path, self.settings.budget, self.settings.preload_timeout,
            self.settings.dump_timeout, self.settings.log_level,
        )  # fmt: skip
        check_socket_path(self.path)
        self._lock.acquire()
        listener = bind_private(self.path, self._lock)
        secure_socket_file(self.path, self.settings.gid)
        listener.listen(64)
        self._listener = listener
        log.info(
            "snapshot service on %s: store %s (budget %s bytes), CRIU %s",
            self.path, self.settings.store, self.settings.budget or "unlimited", self._criu_version,
        )  # fmt: skip

    def serve_forever(self) -> None:
        """Accept until ``stop``; each connection in a short thread of its own."""
        assert self._listener is not None, "bind() first"
        self._listener.settimeout(0.5)
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    break
                raise
            if not self._slots.acquire(blocking=False):
                with conn:
                    _reply(conn, error_reply("busy", "too many snapshot requests at once"))
                continue
            threading.Thread(
                target=self._serve_one, args=(conn,), daemon=True, name="snapshot-request"
            ).start()

    def stop(self) -> None:
        self._stop.set()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.close()
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        self._lock.release()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the takes in flight (tests and shutdown)."""
        for thread in list(self.threads):
            thread.join(timeout)

    def rows(self) -> list[Entry]:
        """The store's snapshots with their use, for the WeightCacheNode status."""
        return self.store.entries()

    # --- requests -------------------------------------------------------------------------------

    def _serve_one(self, conn: socket.socket) -> None:
        try:
            with conn:
                cred = peer_cred(conn, with_groups=True)
                if not self.settings.policy.allows(cred):
                    _reply(
                        conn, error_reply("forbidden", f"uid {cred.uid} may not use this node's snapshots")
                    )
                    return
                try:
                    request, fds = recv_frame(conn, MAX_REQUEST_BYTES, frame_timeout_s=FRAME_TIMEOUT_S)
                except ProtocolError as exc:
                    _reply(conn, error_reply(exc.code, str(exc)))
                    return
                for fd in fds:  # a request carries none
                    os.close(fd)
                who = Requester(cred.uid, cred.gid, tuple(sorted(cred.groups or ())))
                _reply(conn, self.handle(request, who))
        except OSError as exc:
            log.info("snapshot request: connection failed: %s", exc)
        finally:
            self._slots.release()

    def handle(self, request: dict[str, Any], who: Requester) -> dict[str, Any]:
        """One request's reply (see the module docstring)."""
        cmd = request.get("cmd")
        if cmd == "restored":
            digest = request.get("key_digest")
            if not isinstance(digest, str) or not digest.isalnum() or len(digest) > 64:
                return error_reply("bad_request", "key_digest must be a snapshot's key digest")
            counted = self.store.note_restore(digest)
            if counted:
                self.changed.set()
            return {"ok": True, "counted": counted}
        if cmd != "snapshot":
            return error_reply("unknown_command", f"unknown command {str(cmd)[:40]!r}: snapshot or restored")
        parsed = _parse_snapshot(request)
        if isinstance(parsed, str):
            return error_reply("bad_request", parsed)
        asked, config_json, env = parsed
        digest = asked.digest()
        failed = request.get("failed")
        if failed is not None and failed not in SUSPECT:
            return error_reply("bad_request", f"failed must be one of {', '.join(SUSPECT)}")
        if (self.settings.store / digest).is_dir() and failed is None:
            return {"ok": True, "state": "exists"}
        with self._state:
            if self._taking is not None:
                return {"ok": True, "state": "started" if self._taking == digest else "busy"}
            key = check_key(asked, config_json, env, who, self._criu_version)
            if isinstance(key, str):
                log.warning("snapshots: refusing uid %d's request: %s", who.uid, key)
                return error_reply("refused", key)
            self._taking = digest
        thread = threading.Thread(
            target=self._take, args=(key, config_json, env, who), daemon=True, name=f"snapshot-{digest[:8]}"
        )
        self.threads = [t for t in self.threads if t.is_alive()] + [thread]
        thread.start()
        return {"ok": True, "state": "started"}

    def _take(self, key: SnapshotKey, config_json: bytes, env: dict[str, str], who: Requester) -> None:
        assert self._take_settings is not None
        try:
            if (self.settings.store / key.digest()).is_dir():  # a pod found it broken: check it here
                wrong = verify_installed(self.settings.store, key.digest())
                if wrong is None:
                    log.info("snapshots: %s verifies here; kept", key.digest())
                    return
                log.warning(
                    "snapshots: %s does not hold up (%s): removed, taking it again", key.digest(), wrong
                )
                self.store.remove(key.digest())
                self.changed.set()
            taken = take(key, config_json, env, who, self._take_settings)
            if taken.digest is None:
                log.warning("snapshots: no snapshot of %s for uid %d: %s", key.digest(), who.uid, taken.why)
            else:
                log.info("snapshots: took %s for uid %d: %s", taken.digest, who.uid, taken.why)
                self.changed.set()
        except Exception:
            log.exception("snapshots: taking %s failed", key.digest())
        finally:
            with self._state:
                self._taking = None


def _parse_snapshot(request: dict[str, Any]) -> tuple[SnapshotKey, bytes, dict[str, str]] | str:
    """A snapshot request's key, config.json and import variables, or what is wrong with it."""
    try:
        key = SnapshotKey.from_wire(request.get("key"))
    except ValueError as exc:
        return f"key: {exc}"
    config = request.get("config_json")
    env = request.get("env")
    if not isinstance(config, str):
        return "config_json must be the model's config.json as text"
    if not isinstance(env, dict) or len(env) > MAX_ENV:
        return f"env must map at most {MAX_ENV} variable names to values"
    if not all(
        isinstance(k, str) and isinstance(v, str) and "\0" not in k + v and "=" not in k
        for k, v in env.items()
    ):
        return "env must map variable names (no '=' or NUL) to string values"
    return key, config.encode(), env


def _reply(conn: socket.socket, reply: dict[str, Any]) -> None:
    with contextlib.suppress(OSError, ProtocolError):
        send_frame(conn, reply)
