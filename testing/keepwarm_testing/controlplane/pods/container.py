"""Start one container as real processes (through init.py) and keep a handle on it.

A `Launch` is everything the runtime needs, already resolved from the pod spec (argv, env, user,
capabilities, mounts as host paths); `start()` writes it next to the container's log and runs init.py
as root. The handle's `pid1()` is the container's PID 1 as the host sees it (for exec probes).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

INIT = Path(__file__).with_name("init.py")
# The capabilities a container runtime grants when the pod says nothing (containerd's default set).
DEFAULT_CAPABILITIES = (
    "CHOWN", "DAC_OVERRIDE", "FSETID", "FOWNER", "MKNOD", "NET_RAW", "SETGID", "SETUID", "SETFCAP",
    "SETPCAP", "NET_BIND_SERVICE", "SYS_CHROOT", "KILL", "AUDIT_WRITE",
)  # fmt: skip


@dataclass(frozen=True)
class Mount:
    source: str  # host path (resolved, no symlinks)
    target: str  # path inside the container
    read_only: bool = False


@dataclass(frozen=True)
class Launch:
    argv: list[str]  # command + args, $(VAR) already expanded
    env: dict[str, str]  # exactly the container's environment
    uid: int
    gid: int
    groups: list[int]  # supplementary groups
    capabilities: list[str]  # the final set, e.g. ["CHOWN", "FOWNER"] (no CAP_ prefix)
    hostname: str
    working_dir: str = "/"
    mounts: list[Mount] = field(default_factory=list)
    read_only_root: bool = False
    no_new_privs: bool = False
    netns: str | None = None  # /run/netns/<name>; None: the host's network
    cgroup_procs: list[str] = field(default_factory=list)  # cgroup.procs files to join


def effective_capabilities(security: dict) -> list[str]:
    """containerd's defaults, minus `drop` (ALL drops every one), plus `add`."""
    caps = security.get("capabilities") or {}
    drop = {c.upper().removeprefix("CAP_") for c in caps.get("drop") or []}
    add = [c.upper().removeprefix("CAP_") for c in caps.get("add") or []]
    base = [] if "ALL" in drop else [c for c in DEFAULT_CAPABILITIES if c not in drop]
    return sorted(set(base) | set(add))


class Running:
    """A started container: the shim process (init.py's parent half) and its log."""

    def __init__(self, proc: subprocess.Popen, log: Path) -> None:
        self.proc = proc
        self.log = log

    @property
    def shim_pid(self) -> int:
        return self.proc.pid

    def pid1(self) -> int | None:
        """The container's PID 1 in the host's PID namespace (None before the fork or after exit)."""
        try:
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        except OSError:
            return None
        return int(children[0]) if children else None

    def exit_code(self) -> int | None:
        return self.proc.poll()

    def signal(self, sig: signal.Signals) -> None:
        """Through the shim, which forwards it to PID 1 (SIGKILL goes to PID 1 directly)."""
        target = self.pid1() if sig == signal.SIGKILL else self.proc.pid
        with contextlib.suppress(ProcessLookupError):
            os.kill(target or self.proc.pid, sig)


def start(launch: Launch, workdir: Path) -> Running:
    """Run init.py for `launch`; `workdir` (fresh per start) holds launch.json, the log and scratch."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "scratch").mkdir(exist_ok=True)
    spec = {**asdict(launch), "scratch": str(workdir / "scratch")}
    (workdir / "launch.json").write_text(json.dumps(spec))
    log = workdir / "log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-I", str(INIT), str(workdir / "launch.json")],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Running(proc, log)
