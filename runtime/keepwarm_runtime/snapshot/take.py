"""One snapshot taken by the node agent for one pod's request (service.py runs these).

1. The key is the agent's own: computed here from the pod's config.json and import variables with
   the agent's packages, interpreter, code-path variables, CPU, kernel and CRIU, for the peer's uid,
   gid and groups (from the kernel). It must equal the key the pod sent, field by field; otherwise
   the pod runs another image (or lied) and nothing is taken (``check_key``).
2. The parent to checkpoint (server/checkpoint.py) starts under the pod's uid, gid and groups with no
   capability at all (none permitted, an empty bounding set, no_new_privs: what a pod can restore
   unprivileged, whatever its uid), at nice 19 (the pod that asked is importing at the same time),
   in a fresh temporary directory of the store, with only /dev/null, two output pipes (drained into
   the agent's log) and its two control pipes open.
3. Once it says Ready, CRIU dumps it (and kills it) as the same uid, with CAP_CHECKPOINT_RESTORE as
   an ambient capability (setpriv), unprivileged. The parent declared any same-uid process its
   permitted tracer (PR_SET_PTRACER, for Yama's ptrace scope 1), since CRIU is not its ancestor.
4. The images are measured and hashed, the store evicts least-recently-used snapshots to fit its
   budget, and the sealed directory is renamed into place (store.py ``install``).

Nothing partial is ever installed: a failed preload, dump, check or disk (full, over budget) removes
the temporary directory and logs one line saying why; the next pod's request tries again.
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from keepwarm_runtime.snapshot import criu
from keepwarm_runtime.snapshot.key import (
    SnapshotKey,
    code_path_env,
    differing,
    import_env,
    snapshot_key,
    user_identity,
)
from keepwarm_runtime.snapshot.store import IMAGES, Manifest, Store, image_digest, image_files, plan_eviction
from keepwarm_runtime.snapshot.wire import MAX_READY_BYTES, Ready, WireError, read_line

log = logging.getLogger(__name__)
SETPRIV = "setpriv"  # util-linux: CRIU runs as the pod's uid with one ambient capability
# coreutils: the parent starts at nice 19 (set before the uid changes: once the parent is the pod's
# uid, the agent, root without CAP_SYS_NICE, may not renice it; seen on the real node)
NICE = ("nice", "-n", "19")
# The parent to checkpoint: the server's (a module name, run as a program: the snapshot package sits
# below the server and never imports it).
CHECKPOINTED = "keepwarm_runtime.server.checkpoint"
PID_FLOOR = 300  # the checkpointed parent's pid is above this: free in any pod (raise_pid_floor)
DEVICES = ("cpu", "cuda")  # what the checkpointed parent's --device takes (key.preload_device)


@dataclass(frozen=True)
class Requester:
    """Who asked, from the kernel (SO_PEERCRED, SO_PEERGROUPS): the snapshot runs as them."""

    uid: int
    gid: int
    groups: tuple[int, ...]  # supplementary groups

    @property
    def user(self) -> str:
        return user_identity(self.uid, self.gid, self.groups)


@dataclass(frozen=True)
class TakeSettings:
    store: Store
    criu_path: str  # absolute (criu.locate)
    budget: int | None  # bytes the store may hold; None: no limit but the disk
    preload_timeout: float  # seconds the parent may take to preload
    dump_timeout: float  # seconds CRIU may take to dump it
    log_level: str = "INFO"  # the parent's logging (its lines land in the agent's log)


@dataclass(frozen=True)
class Taken:
    """What one take did: the installed digest, or why none."""

    digest: str | None
    why: str  # "installed in 2.1s" or the reason nothing was installed


def preload_env(pod_env: Mapping[str, str], agent_env: Mapping[str, str]) -> dict[str, str]:
    """The parent's environment: the pod's import variables, the agent's code-path ones. Pure."""
    return {**import_env(pod_env), **code_path_env(agent_env)}


def check_key(
    asked: SnapshotKey, config_json: bytes, pod_env: Mapping[str, str], who: Requester, criu_version: str
) -> SnapshotKey | str:
    """The key this agent would take for the request, or why it refuses: the fields in which the pod's
    own key differs (another image, another CRIU, another user than the kernel says)."""
    if asked.device not in DEVICES:
        return f"device {asked.device[:20]!r}: a snapshot's parent preloads for one of {', '.join(DEVICES)}"
    key = snapshot_key(config_json, preload_env(pod_env, os.environ), criu_version, who.user, asked.device)
    if fields := differing(key, asked):
        return (
            f"this node agent would take another snapshot than the pod asks for (fields {', '.join(fields)})"
        )
    return key


def take(
    key: SnapshotKey, config_json: bytes, pod_env: Mapping[str, str], who: Requester, settings: TakeSettings
) -> Taken:
    """Take and install one snapshot of ``key`` (already checked): see the module docstring."""
    started = time.monotonic()
    store = settings.store
    temp = store.temp_dir(key.digest())
    try:
        taken = _take_into(temp, key, config_json, pod_env, who, settings)
    finally:
        reclaim(temp)  # the pod's uid may own what is left: root can remove it only once it is root's
        shutil.rmtree(temp, ignore_errors=True)
    if taken.digest is None:
        return taken
    return Taken(taken.digest, f"installed in {time.monotonic() - started:.1f}s ({taken.why})")


def _take_into(
    temp: Path, key: SnapshotKey, config_json: bytes, pod_env: Mapping[str, str], who: Requester,
    settings: TakeSettings,
) -> Taken:  # fmt: skip
    """Prepare, dump and install from ``temp``: see ``take``."""
    images, work = temp / IMAGES, temp / "work"
    for path in (images, work):
        path.mkdir(mode=0o700)
    (work / "config.json").write_bytes(config_json)
    hand_over(temp, who.uid, who.gid)
    raise_pid_floor()
    parent = _Parent.start(work, preload_env(pod_env, os.environ), who, settings.log_level, key.device)
    try:
        ready = parent.wait_ready(settings.preload_timeout)
        if isinstance(ready, str):
            return Taken(None, ready)
        free = shutil.disk_usage(temp).free
        if free < (rss := _rss_bytes(parent.proc.pid)):
            return Taken(
                None, f"disk full: {free} bytes free in {settings.store.root}, the parent holds {rss}"
            )
        dump = criu.run(
            [
                *_with_capability(who, "checkpoint_restore"),
                *criu.dump_argv(settings.criu_path, parent.proc.pid, images, work),
            ],
            settings.dump_timeout,
            work / "dump.log",
        )
        if dump.code != 0:
            why = "timed out" if dump.timed_out else f"exited {dump.code}"
            return Taken(None, f"criu dump {why} after {dump.seconds:.1f}s: {dump.log_tail}")
    finally:
        parent.end()
    reclaim(temp)
    files = image_files(images)
    size = sum(f.size for f in files.values())
    evict = plan_eviction(settings.store.entries(), size, settings.budget)
    if evict is None:
        return Taken(None, f"over budget: the snapshot is {size} bytes, the store's budget {settings.budget}")
    for old in evict:
        log.info("snapshots: evicting %s (least recently used) to fit the budget", old)
        settings.store.remove(old)
    shutil.rmtree(work)
    manifest = Manifest(
        key=key, images=files, image_digest=image_digest(files), created=time.time(), pid=ready.pid,
        pipes=parent.pipes, mapped=ready.mapped, preload_s=ready.preload_s, dump_s=dump.seconds,
    )  # fmt: skip
    try:
        installed = settings.store.install(temp, manifest, who.gid)
    except FileExistsError:
        return Taken(None, "another take installed this key first")
    return Taken(installed.name, f"{size} bytes; preload {ready.preload_s:.1f}s, dump {dump.seconds:.1f}s")


def hand_over(temp: Path, uid: int, gid: int) -> None:
    """Give the snapshot's temporary directory to the pod's uid (the parent and CRIU's dump write in
    it), deepest first: the agent is root without CAP_DAC_OVERRIDE or CAP_DAC_READ_SEARCH (only CHOWN
    and FOWNER among the file capabilities), so once a 0700 directory is another uid's, root cannot
    look inside it any more."""
    for dirpath, dirnames, filenames in os.walk(temp, topdown=False):
        for name in (*filenames, *dirnames):
            os.chown(os.path.join(dirpath, name), uid, gid, follow_symlinks=False)
    os.chown(temp, uid, gid)


def reclaim(temp: Path) -> None:
    """Take the temporary directory back for root, outermost first (the reverse of ``hand_over``: root
    may enter each directory once it owns it), so the agent can hash, seal or remove what CRIU wrote."""
    if not temp.is_dir():
        return
    os.chown(temp, 0, 0)
    for dirpath, dirnames, filenames in os.walk(temp):  # top-down: each directory is root's before it is read
        for name in (*dirnames, *filenames):
            os.chown(os.path.join(dirpath, name), 0, 0, follow_symlinks=False)


def _as_user(who: Requester) -> list[str]:
    """setpriv's arguments running a command as ``who`` (its capability options follow)."""
    groups = ",".join(str(g) for g in who.groups)
    return [
        SETPRIV,
        f"--reuid={who.uid}",
        f"--regid={who.gid}",
        f"--groups={groups}" if groups else "--clear-groups",
    ]


def _with_capability(who: Requester, capability: str) -> list[str]:
    """setpriv's prefix running a command as ``who`` with one ambient capability."""
    return [*_as_user(who), f"--inh-caps=+{capability}", f"--ambient-caps=+{capability}", "--"]


def raise_pid_floor(floor: int = PID_FLOOR, last_pid: Path = Path("/proc/sys/kernel/ns_last_pid")) -> int:
    """Make the next process of this PID namespace get a pid above ``floor`` (threads take pid numbers
    too: start and join short ones until the counter passes it); returns the counter then. A restore
    recreates the parent's pid in the pod, where the launcher and CRIU hold the first few."""
    try:
        last = int(last_pid.read_text())
    except (OSError, ValueError):
        return 0
    while last < floor:
        batch = [threading.Thread(target=lambda: None) for _ in range(min(64, floor - last))]
        for thread in batch:
            thread.start()
        for thread in batch:
            thread.join()
        try:
            last = int(last_pid.read_text())
        except (OSError, ValueError):
            return 0
    return last


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


class _Parent:
    """The process to checkpoint, with its pipes: started, awaited, ended."""

    def __init__(self, proc: subprocess.Popen, control_w: int, ready_r: int) -> None:
        self.proc, self.control_w, self.ready_r = proc, control_w, ready_r
        assert proc.stdout is not None and proc.stderr is not None
        # CRIU's names of the parent's four pipes (a restore replaces each), read before the drains
        # close their ends.
        self.pipes = {
            "stdout": criu.pipe_id(proc.stdout.fileno()),
            "stderr": criu.pipe_id(proc.stderr.fileno()),
            "control": criu.pipe_id(control_w),
            "ready": criu.pipe_id(ready_r),
        }
        self._drains = [
            threading.Thread(target=_drain, args=(stream, name), daemon=True, name=f"snapshot-{name}")
            for name, stream in (("stdout", proc.stdout), ("stderr", proc.stderr))
        ]
        for thread in self._drains:
            thread.start()

    @classmethod
    def start(cls, work: Path, env: dict[str, str], who: Requester, log_level: str, device: str) -> _Parent:
        control_r, control_w = os.pipe()
        ready_r, ready_w = os.pipe()
        argv = [
            *NICE, *_as_user(who), "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--",
            sys.executable, "-m", CHECKPOINTED, str(work), log_level,
            "--control-fd", str(control_r), "--ready-fd", str(ready_w), "--device", device,
        ]  # fmt: skip
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(control_r, ready_w),
                close_fds=True,
                cwd="/",
                env=env,
                start_new_session=True,  # CRIU dumps a session leader (its own session and group)
            )
        finally:
            os.close(control_r)
            os.close(ready_w)
        return cls(proc, control_w, ready_r)

    def wait_ready(self, timeout: float) -> Ready | str:
        """The parent's Ready, or why it never came (it ended, timed out, said something else)."""
        if not select.select([self.ready_r], [], [], timeout)[0]:
            return f"the parent did not preload within {timeout:g}s"
        try:
            line = read_line(self.ready_r, MAX_READY_BYTES)
            if not line:
                return f"the parent ended before it was ready ({self._exit()})"
            ready = Ready.decode(line)
        except (OSError, WireError) as exc:
            return f"the parent's ready message is not one: {exc}"
        if ready.pid != self.proc.pid:
            return f"the parent says it is pid {ready.pid}, it is {self.proc.pid}"
        return ready

    def end(self) -> None:
        """Kill the parent if CRIU left it alive (it kills it after a dump), reap it, close the pipes."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for thread in self._drains:
            thread.join(timeout=5)
        for fd in (self.control_w, self.ready_r):
            os.close(fd)

    def _exit(self) -> str:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "still running"
        return f"exit {code}"


def _drain(stream, name: str) -> None:
    """Log the parent's output (its own log lines) until it ends."""
    for raw in iter(stream.readline, b""):
        log.info("snapshot parent %s: %s", name, raw.decode(errors="replace").rstrip())
    stream.close()
