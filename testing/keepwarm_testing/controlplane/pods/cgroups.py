"""One cgroup per pod, with the memory and CPU limits of its containers, and a sure way to kill it.

cgroup v2 when /sys/fs/cgroup is a unified hierarchy; otherwise the v1 controllers memory, cpu and
pids (this machine's layout). The pod's cgroup is `<controller>/<group>/<pod uid>`, where `group` is
`kwt-<hex>` per harness; every process of the pod (the container shims and everything they start)
lives in it, so `kill_all()` finds them all, even a daemon that double-forked.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("memory", "cpu", "pids")
CFS_PERIOD_US = 100_000


def unified() -> bool:
    return (CGROUP_ROOT / "cgroup.controllers").exists()


@dataclass(frozen=True)
class Limits:
    memory_bytes: int | None = None  # sum of the containers' memory limits (None: some has none)
    cpu_millis: int | None = None  # sum of the containers' CPU limits in millicores


@dataclass(frozen=True)
class PodCgroup:
    group: str  # per-harness parent, e.g. kwt-1a2b
    pod_uid: str

    def paths(self) -> list[Path]:
        """The pod's directory in each hierarchy (one on v2)."""
        if unified():
            return [CGROUP_ROOT / self.group / self.pod_uid]
        return [CGROUP_ROOT / c / self.group / self.pod_uid for c in V1_CONTROLLERS]

    def create(self, limits: Limits) -> None:
        for path in self.paths():
            path.mkdir(parents=True, exist_ok=True)
        if unified():
            self._v2_limits(limits)
        else:
            self._v1_limits(limits)

    def _v1_limits(self, limits: Limits) -> None:
        base = CGROUP_ROOT
        if limits.memory_bytes is not None:
            (base / "memory" / self.group / self.pod_uid / "memory.limit_in_bytes").write_text(
                str(limits.memory_bytes)
            )
        if limits.cpu_millis is not None:
            cpu = base / "cpu" / self.group / self.pod_uid
            (cpu / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
            (cpu / "cpu.cfs_quota_us").write_text(str(max(1000, limits.cpu_millis * CFS_PERIOD_US // 1000)))

    def _v2_limits(self, limits: Limits) -> None:
        parent = CGROUP_ROOT / self.group
        (parent / "cgroup.subtree_control").write_text("+memory +cpu +pids")
        path = parent / self.pod_uid
        if limits.memory_bytes is not None:
            (path / "memory.max").write_text(str(limits.memory_bytes))
        if limits.cpu_millis is not None:
            (path / "cpu.max").write_text(f"{limits.cpu_millis * CFS_PERIOD_US // 1000} {CFS_PERIOD_US}")

    def procs_files(self) -> list[Path]:
        """The cgroup.procs files a new process writes its pid into (one per hierarchy)."""
        return [path / "cgroup.procs" for path in self.paths()]

    def pids(self) -> set[int]:
        found: set[int] = set()
        for procs in self.procs_files():
            with contextlib.suppress(OSError):
                found |= {int(line) for line in procs.read_text().split()}
        return found

    def kill_all(self, timeout_s: float = 10.0) -> None:
        """SIGKILL every process in the pod's cgroup until it is empty."""
        deadline = time.monotonic() + timeout_s
        while (pids := self.pids()) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        if self.pids():
            raise RuntimeError(f"pod cgroup {self.pod_uid}: processes survive SIGKILL: {sorted(self.pids())}")

    def remove(self) -> None:
        """Kill what is left and delete the pod's cgroup directories (idempotent)."""
        self.kill_all()
        for path in self.paths():
            for _ in range(50):  # the kernel may still be reaping the last task
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.05)


def remove_group(group: str) -> None:
    """Delete the per-harness parent directories once every pod's cgroup is gone."""
    parents = [CGROUP_ROOT / group] if unified() else [CGROUP_ROOT / c / group for c in V1_CONTROLLERS]
    for parent in parents:
        for child in parent.iterdir() if parent.is_dir() else ():
            if child.is_dir():
                PodCgroup(group, child.name).remove()
        with contextlib.suppress(OSError):
            parent.rmdir()
