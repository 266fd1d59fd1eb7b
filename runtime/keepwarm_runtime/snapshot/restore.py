"""`keepwarm serve`'s launcher: restore the prepared parent from the node's snapshot, or say why not.

Runs first thing in `keepwarm serve` (server/cli.py), before anything heavy is imported (the standard
library, the settings and this package only), typically as the container's PID 1:

1. compute this start's key (key.py) and look it up in the read-only store (store.py ``lookup``:
   key, mapped files, the digests of all but the page files);
2. restore it with CRIU, detached, this process a child subreaper so the restored parent becomes
   its child, with its own stdout and stderr and two fresh pipes in place of the snapshot's;
3. once the page files' digests (hashed while CRIU ran) match, hand the restored parent its Context
   (wire.py) and wait for RESUMED;
4. tell the agent (client.py ``report_restore``) and stay as a small init (``stay_init``): forward
   SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 to the parent, reap whatever is reparented
   here, and exit with the parent's code (128 + the signal when a signal ended it); but when the
   parent fails without being told to stop, import in its place (``leave_init``), so a snapshot that
   restores but does not serve can never crash-loop a pod.

Any miss or failure returns a StartupSource saying why; the caller then imports, in this very
process, as without snapshots, and asks the agent for a snapshot of this key
(``ask_for_snapshot``), which never delays its start. A failed or killed restore leaves nothing
behind: every child of this process is killed and reaped before it imports.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import logging
import os
import select
import signal
import socket
import stat
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from keepwarm_runtime.process_start import process_start_time
from keepwarm_runtime.snapshot import client, criu, fresh, handover
from keepwarm_runtime.snapshot.key import snapshot_key, this_process_user
from keepwarm_runtime.snapshot.outcome import BROKEN, Reason, Source, StartupSource
from keepwarm_runtime.snapshot.store import Found, Miss, lookup, verify_pages
from keepwarm_runtime.snapshot.wire import RESUMED, Context, write_all

log = logging.getLogger(__name__)
_PR_SET_CHILD_SUBREAPER = 36
_relays: list[threading.Thread] = []  # copying a restored parent's output (see _Pipes)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


@dataclass(frozen=True)
class LaunchSettings:
    """What the launcher needs from `keepwarm serve`'s settings."""

    store: Path  # the node's snapshot store (read-only here)
    criu: str  # the CRIU binary (a path or a name on PATH)
    model_dir: str  # the served checkpoint: its config.json is part of the key
    device: str  # "cuda" or "cpu" (key.preload_device of --device)
    socket_dir: str | None  # the node cache's socket directory (the agent's snapshot service)
    restore_timeout: float  # seconds CRIU may take, and then the restored parent to resume
    listener: socket.socket | None = None  # the API socket bound at start, handed to the restored parent


@dataclass(frozen=True)
class Restored:
    pid: int  # the restored parent, this process's child
    outcome: StartupSource


def launch(settings: LaunchSettings) -> Restored | StartupSource:
    """Restore this start's snapshot (Restored), or the StartupSource of an importing start saying
    why not, after asking the agent for a snapshot when one could be taken."""
    started_at = process_start_time()
    try:
        criu_path = criu.locate(settings.criu)
        criu_version = criu.version(criu_path)
    except criu.CriuMissing as exc:
        log.warning("snapshots: importing (%s): %s", Reason.NO_CRIU, exc)
        return StartupSource(Source.IMPORTS, Reason.NO_CRIU)
    config_json = _config_json(settings.model_dir)
    key = snapshot_key(config_json, os.environ, criu_version, this_process_user(), settings.device)
    looked_at = time.time()
    found = lookup(settings.store, key)
    if isinstance(found, Miss):
        log.info("snapshots: importing (%s): %s", found.reason, found.detail)
        failed = found.reason.value if found.reason in BROKEN else None
        client.ask_for_snapshot(settings.socket_dir, key, config_json, dict(os.environ), failed)
        return StartupSource(Source.IMPORTS, found.reason, key_digest=key.digest())
    result = restore(found, criu_path, started_at, settings.restore_timeout, settings.listener)
    if isinstance(result, Miss):
        log.warning("snapshots: importing (%s): %s", result.reason, result.detail)
        if result.reason in BROKEN:  # the pages did not hash to their digests: have the agent check
            client.ask_for_snapshot(
                settings.socket_dir, key, config_json, dict(os.environ), result.reason.value
            )
        return StartupSource(Source.IMPORTS, result.reason, key_digest=key.digest())
    now = time.time()
    log.info(
        "snapshots: restored %s as pid %d, %.2fs after this process started (%.2fs before the lookup, "
        "%.2fs checks and restore)",
        key.digest(),
        result,
        now - started_at,
        looked_at - started_at,
        now - looked_at,
    )
    client.report_restore(settings.socket_dir, key.digest())
    return Restored(result, StartupSource(Source.SNAPSHOT, Reason.HIT, now - started_at, key.digest()))


def restore(
    found: Found, criu_path: str, started_at: float, timeout: float, api: socket.socket | None = None
) -> int | Miss:
    """Restore ``found`` and hand it its context (and ``api``, the listening socket, when given): the
    restored parent's pid, or the Miss saying why not (then every child of this process, whatever the
    restore left, is killed and reaped)."""
    _become_subreaper()
    try:
        result = _restore(found, criu_path, started_at, timeout, api)
    except BaseException:
        kill_children()
        raise
    if isinstance(result, Miss):
        kill_children()
    return result


def _restore(
    found: Found, criu_path: str, started_at: float, timeout: float, api: socket.socket | None
) -> int | Miss:
    restore_started = time.time()
    fds = _Pipes.open()
    pipes = found.manifest.pipes
    inherit = {
        fds.stdout: pipes["stdout"], fds.stderr: pipes["stderr"],
        fds.control_r: pipes["control"], fds.ready_w: pipes["ready"],
    }  # fmt: skip
    try:
        with (
            tempfile.TemporaryDirectory(prefix="keepwarm-restore-") as work,
            concurrent.futures.ThreadPoolExecutor(1) as pool,
        ):
            pages = pool.submit(_pages_timed, found)  # the bulk of the digest, while CRIU restores
            pidfile = Path(work) / "restored.pid"
            argv = criu.restore_argv(criu_path, found.images, Path(work), inherit, pidfile)
            run = criu.run(argv, timeout, Path(work) / "restore.log", tuple(inherit), inherit_stdio=True)
            pid = _read_pid(pidfile)
            wrong_pages, digest_s = pages.result()
        fds.close_restored_ends()
        if wrong_pages is not None:
            return wrong_pages
        if run.code != 0 or pid is None:
            why = "timed out" if run.timed_out else f"exited {run.code}"
            return Miss(Reason.RESTORE_FAILED, f"criu restore {why} after {run.seconds:.2f}s: {run.log_tail}")
        offer = handover.Offer() if api is not None else None
        context = Context(
            argv=tuple(sys.argv),
            env=dict(os.environ),
            cwd=os.getcwd(),
            umask=_umask(),
            started_at=started_at,
            restore_started_at=restore_started,
            key_digest=found.path.name,
            log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()),
            rlimits=fresh.current_rlimits(),
            listener=offer.address if offer is not None else None,
        )
        try:
            write_all(fds.control_w, context.encode())
        except OSError as exc:
            if offer is not None:
                offer.close()
            return Miss(Reason.RESUME_FAILED, f"the restored parent took no context: {exc}")
        fds.close_control()
        if offer is not None and api is not None:
            offer.hand_over(api, pid, timeout, fds.ready_r)
            # The restored parent holds it now, or binds its own, which this copy would keep in use.
            api.close()
        if not _resumed(fds.ready_r, timeout):
            return Miss(Reason.RESUME_FAILED, f"the restored parent did not resume within {timeout:g}s")
        fds.start_relays()
        log.info(
            "snapshots: criu restore %.2fs, page digests %.2fs beside it, resumed %.2fs after it began",
            run.seconds,
            digest_s,
            time.time() - restore_started,
        )
        return pid
    finally:
        fds.close()


def _pages_timed(found: Found) -> tuple[Miss | None, float]:
    """verify_pages and its seconds (logged beside CRIU's: the two run side by side)."""
    started = time.perf_counter()
    return verify_pages(found), time.perf_counter() - started


class _Pipes:
    """The launcher's side of a restore's four pipes. The restored parent's stdout and stderr are
    this process's own when they are pipes it owns: CRIU reopens them through /proc/self/fd, which
    only their owner may (runc chowns a container's stdio pipes to its user). Anything else (a file,
    a terminal, a pipe of root's) is relayed: CRIU gets a fresh pipe and this process copies it to
    its own descriptor once the parent has resumed."""

    def __init__(self) -> None:
        self.control_r, self.control_w = os.pipe()
        self.ready_r, self.ready_w = os.pipe()
        self.relays: dict[int, int] = {}  # read end -> the descriptor it is copied to
        self.stdout = self._stdio(1)
        self.stderr = self._stdio(2)

    @classmethod
    def open(cls) -> _Pipes:
        return cls()

    def _stdio(self, fd: int) -> int:
        try:
            st = os.fstat(fd)
            if stat.S_ISFIFO(st.st_mode) and st.st_uid == os.geteuid():
                return fd
        except OSError:
            pass
        read_end, write_end = os.pipe()
        self.relays[read_end] = fd
        return write_end

    def close_restored_ends(self) -> None:
        """Close this process's copies of what the restored parent now holds (EOF then means it died)."""
        ends = [self.control_r, self.ready_w] + [fd for fd in (self.stdout, self.stderr) if fd not in (1, 2)]
        for fd in ends:
            _close(fd)
        self.control_r = self.ready_w = -1
        self.stdout, self.stderr = 1, 2

    def close_control(self) -> None:
        _close(self.control_w)
        self.control_w = -1

    def start_relays(self) -> None:
        for read_end, target in self.relays.items():
            thread = threading.Thread(
                target=_relay, args=(read_end, target), daemon=True, name=f"relay-{target}"
            )
            thread.start()
            _relays.append(thread)
        self.relays = {}

    def close(self) -> None:
        """Close whatever was not handed over (all of it after a failure)."""
        for fd in (self.control_r, self.control_w, self.ready_r, self.ready_w, *self.relays):
            _close(fd)
        for fd in (self.stdout, self.stderr):
            if fd not in (1, 2):
                _close(fd)


def _close(fd: int) -> None:
    if fd >= 0:
        with contextlib.suppress(OSError):
            os.close(fd)


def _relay(read_end: int, target: int) -> None:
    """Copy the restored parent's output to this process's descriptor until every writer is gone."""
    try:
        while chunk := os.read(read_end, 65536):
            write_all(target, chunk)
    except OSError:
        pass
    finally:
        os.close(read_end)


@dataclass(frozen=True)
class Ended:
    """How the restored parent ended."""

    code: int  # its exit code (128 + N when signal N ended it)
    stopped: bool  # this launcher had forwarded a stop signal to it

    @property
    def unasked(self) -> bool:
        """It failed without being told to stop: the pod imports in its place (no crash loop)."""
        return self.code != 0 and not self.stopped


def stay_init(pid: int) -> Ended:
    """Forward stop signals to the restored parent and reap every child until the parent has ended."""
    forwarded: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        forwarded.append(signum)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    while True:
        try:
            child, status = os.wait()
        except ChildProcessError:
            return Ended(1, bool(forwarded))  # the parent is gone and nothing was reaped: cannot happen
        if child == pid:
            code = 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.waitstatus_to_exitcode(status)
            return Ended(code, bool(forwarded))


def leave_init() -> None:
    """Before this process imports in place of a restored parent that failed: the default signal
    actions back, everything the parent left killed and reaped, the output relays ended (the parent
    forks with one thread)."""
    for sig in FORWARDED:
        signal.signal(sig, signal.SIG_DFL)
    kill_children()
    for thread in _relays:
        thread.join(timeout=5)
    _relays.clear()


def kill_children() -> None:
    """Kill and reap every child of this process (what a failed restore may leave, reparented here)."""
    me = str(os.getpid())
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = f.read().rsplit(")", 1)[1].split()[1]
        except (OSError, IndexError):
            continue
        if ppid == me:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry), signal.SIGKILL)
    while True:
        try:
            if os.waitpid(-1, 0)[0] == 0:
                break
        except ChildProcessError:
            break


def _resumed(ready_r: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    data = b""
    while len(data) < len(RESUMED):
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([ready_r], [], [], remaining)[0]:
            return False
        chunk = os.read(ready_r, len(RESUMED) - len(data))
        if not chunk:
            return False
        data += chunk
    return data == RESUMED


def _become_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def _read_pid(pidfile: Path) -> int | None:
    try:
        return int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return None


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _config_json(model_dir: str) -> bytes:
    try:
        with open(os.path.join(model_dir, "config.json"), "rb") as f:
            return f.read(1 << 20)
    except OSError:
        return b""
