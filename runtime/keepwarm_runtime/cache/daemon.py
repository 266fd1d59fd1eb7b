"""The cache daemon: loads checkpoints once, holds them in a tier, serves them over a Unix socket.

``CacheDaemon`` is also the in-process API of the node agent (``add_model``, ``remove_model``,
``snapshot`` are thread-safe). The socket is bound only after the initial models are resident, so
a client that can connect can attach; one ``READY`` line on stderr says so.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keepwarm_runtime import __version__
from keepwarm_runtime.cache import protocol, security
from keepwarm_runtime.cache.checkpoint import parse_dtype, read_checkpoint
from keepwarm_runtime.cache.fingerprint import compute_key
from keepwarm_runtime.cache.handlers import CommandHandlers
from keepwarm_runtime.cache.loader import fill_arena, plan_layout
from keepwarm_runtime.cache.metrics import DaemonMetrics
from keepwarm_runtime.cache.registry import ModelRegistry, ResidentModel

log = logging.getLogger(__name__)
IDLE_TIMEOUT_S = 300.0  # a connection silent this long (or stuck mid-frame) is closed


@dataclass
class DaemonConfig:
    socket_dir: Path
    tier: str = "auto"  # "auto" (gpu when CUDA is present) | "gpu" | "host"
    device: str = "cuda:0"  # gpu tier: which GPU
    dtype: str = "bfloat16"  # serving dtype of floating tensors
    budget: int | None = None  # bytes; LRU-evict unpinned models beyond it
    pins: frozenset[str] = frozenset()  # model names (directory names) never evicted
    group: str | None = None  # socket dir 0770 / socket 0660 with this group
    allow_uids: frozenset[int] = frozenset()
    allow_gids: frozenset[int] = frozenset()
    metrics_port: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def resolve_tier(tier: str) -> str:
    if tier not in ("auto", "gpu", "host"):
        raise ValueError(f"unknown tier {tier!r}; use auto, gpu or host")
    if tier != "auto":
        return tier
    import torch

    return "gpu" if torch.cuda.is_available() else "host"


def socket_name(tier: str, gpu_uuid: str | None) -> str:
    return f"gpu-{gpu_uuid}.sock" if tier == "gpu" else "host.sock"


class CacheDaemon:
    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.tier = resolve_tier(config.tier)
        self.dtype = parse_dtype(config.dtype)
        self.gpu_uuid: str | None = None
        self.device_ordinal = 0
        if self.tier == "gpu":
            from keepwarm_runtime.cache.backends import cuda

            self.device_ordinal = cuda.device_ordinal(config.device)
            self.gpu_uuid = cuda.gpu_uuid(self.device_ordinal)
        self.socket_dir = Path(config.socket_dir)
        self.socket_path = self.socket_dir / socket_name(self.tier, self.gpu_uuid)
        self.registry = ModelRegistry(config.budget)
        self.metrics = DaemonMetrics()
        self.handlers = CommandHandlers(self)
        self.policy = security.PeerPolicy(allow_uids=config.allow_uids, allow_gids=config.allow_gids)
        self._gid = security.resolve_gid(config.group)
        self._load_lock = threading.Lock()
        self._stop = threading.Event()
        self._lock = security.DaemonLock(self.socket_path)
        self._listener: socket.socket | None = None
        self.started_at = time.time()

    # -- node agent API -------------------------------------------------------------------------

    def add_model(self, path: str | Path, pin: bool = False) -> str:
        """Load ``path`` (once; a second call is a no-op) and return its model name."""
        path = Path(path).resolve()
        with self._load_lock:
            shards = read_checkpoint(path)
            key = compute_key(path, self.dtype, shards=shards)
            name = self.registry.unique_name(path)
            current = self.registry.get(name)
            if current is not None and current.key == key:
                current.pinned = current.pinned or pin
                return name
            pinned = pin or name in self.config.pins or path.name in self.config.pins
            layout = plan_layout(shards, self.dtype)
            for victim in self.registry.reserve(layout.size, keep=name):
                self._drop(victim, "evicted for --budget")
                self.metrics.evictions.inc()
            started = time.perf_counter()
            arena = self._new_arena(name, layout.size)
            try:
                digest = fill_arena(arena, shards, layout)
                arena.seal()
            except BaseException:
                arena.close()
                raise
            seconds = time.perf_counter() - started
            model = ResidentModel(
                name, path, key, layout, arena, self.tier, digest, pinned, seconds, gpu_uuid=self.gpu_uuid
            )
            old = self.registry.remove(name)
            if old is not None:
                self._drop(old, "replaced by a new version")
            self.registry.insert(model)
            self.metrics.resident_bytes.labels(name, self.tier).set(model.nbytes)
            self.metrics.load_seconds.labels(name).set(seconds)
            log.info(
                "loaded %s (%d tensors, %.2f GiB %s, %s pages) in %.2fs",
                name,
                len(layout.entries),
                model.nbytes / 2**30,
                self.tier,
                arena.page_mode,
                seconds,
            )
            return name

    def remove_model(self, name: str) -> bool:
        model = self.registry.remove(name)
        if model is None:
            return False
        self._drop(model, "released")
        return True

    def snapshot(self) -> dict[str, Any]:
        return {
            "version": __version__,
            "pid": os.getpid(),
            "tier": self.tier,
            "socket": str(self.socket_path),
            "dtype": self.config.dtype,
            "budget": self.config.budget,
            "resident_bytes": self.registry.resident_bytes(),
            "gpu_uuid": self.gpu_uuid,
            "models": {m.name: m.describe() for m in self.registry.models()},
        }

    def _new_arena(self, name: str, size: int):
        if self.tier == "gpu":
            from keepwarm_runtime.cache.backends.cuda import CudaArena

            return CudaArena(name, size, self.device_ordinal)
        from keepwarm_runtime.cache.backends.host import HostArena

        return HostArena(name, size)

    def _drop(self, model: ResidentModel, why: str) -> None:
        # Clients that mapped it keep their mapping: the kernel/driver frees it after the last unmap.
        model.arena.close()
        self.metrics.resident_bytes.remove(model.name, model.tier)
        log.info("dropped %s (%s)", model.name, why)

    # -- socket server --------------------------------------------------------------------------

    def bind(self) -> None:
        """Take the lock, clear a stale socket, bind and listen (call once models are loaded)."""
        security.prepare_socket_dir(self.socket_dir, self._gid)
        self._lock.acquire()
        security.remove_stale_socket(self.socket_path, self._lock)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            listener.bind(str(self.socket_path))
        finally:
            os.umask(old_umask)
        security.secure_socket_file(self.socket_path, self._gid)
        listener.listen(64)
        listener.settimeout(0.2)
        self._listener = listener
        if self.config.metrics_port is not None:
            self.metrics.serve(self.config.metrics_port)

    def serve_forever(self) -> None:
        if self._listener is None:
            self.bind()
        names = ",".join(m.name for m in self.registry.models()) or "-"
        print(
            f"READY keepwarm cache socket={self.socket_path} tier={self.tier} models={names} "
            f"pid={os.getpid()}",
            file=sys.stderr,
            flush=True,
        )
        try:
            while not self._stop.is_set():
                try:
                    conn, _ = self._listener.accept()
                except TimeoutError:
                    continue
                threading.Thread(target=self._serve_connection, args=(conn,), daemon=True).start()
        finally:
            self.close()

    def stop(self) -> None:
        """Ask ``serve_forever`` to return (safe from a signal handler)."""
        self._stop.set()

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            if self._lock.held:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.socket_path)
        self._lock.release()
        for model in self.registry.models():
            self.remove_model(model.name)

    def _serve_connection(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(IDLE_TIMEOUT_S)
            try:
                cred = security.peer_cred(conn)
                if not self.policy.allows(cred.uid, cred.gid):
                    self.metrics.refused_peers.inc()
                    log.warning("refused peer pid=%d uid=%d gid=%d", cred.pid, cred.uid, cred.gid)
                    protocol.send_frame(
                        conn,
                        protocol.error_reply(
                            "forbidden",
                            f"uid {cred.uid}/gid {cred.gid} is not allowed; start the daemon "
                            "with --allow-uid or --allow-gid",
                        ),
                    )
                    return
                while not self._stop.is_set():
                    try:
                        request, fds = protocol.recv_frame(conn, protocol.MAX_REQUEST_BYTES)
                    except protocol.PeerClosed:
                        return
                    except protocol.ProtocolError as exc:
                        protocol.send_frame(conn, protocol.error_reply(exc.code, str(exc)))
                        return
                    for fd in fds:  # clients have no business sending fds
                        os.close(fd)
                    reply, out_fds = self.handlers.dispatch(request)
                    try:
                        protocol.send_frame(conn, reply, out_fds)
                    finally:
                        for fd in out_fds:
                            os.close(fd)
            except OSError as exc:  # peer vanished, timed out, or reset mid-reply
                log.debug("connection ended: %s", exc)
