"""How many intra-op threads a CPU engine should use, and an OpenMP that spins briefly, then sleeps.

torch's default (one thread per CPU the machine has) is wrong for a pod: the process may be pinned to
fewer CPUs (``sched_getaffinity``) or capped by a CFS quota (cgroup v2 ``cpu.max``, v1
``cpu.cfs_quota_us``/``cpu.cfs_period_us``), and a node's CPUs are shared. Every intra-op parallel
region ends in a barrier, so one thread without a core stalls the others; with OpenMP's default wait
policy the waiting threads spin and take the very core the straggler needs (measured on a 2-core
machine beside a busy process: 56 s for 40 tokens that take 0.7 s alone).

So: threads = ``--threads`` / ``KEEPWARM_THREADS`` if given, else ``OMP_NUM_THREADS`` if the user set
it, else min(CPUs in the affinity mask, floor(quota)), at least 1; and waiting OpenMP threads spin a
bounded while, then sleep (``GOMP_SPINCOUNT``, ``KMP_BLOCKTIME`` for Intel's runtime) unless the user
chose a wait policy. Not ``OMP_WAIT_POLICY=PASSIVE``: a thread that sleeps at once must be woken
through the kernel for every parallel region, and a decode step of a small model is hundreds of short
regions (element-wise ops over a batch's hidden states): measured on a 2-core VM, a [64, 768] float32
multiply took 115 us passive and 9 us with a bounded spin, and the fixed throughput workload ran
at 142 tokens/s passive, 294 / 344 / 382 with 1,000 / 10,000 / 100,000 spins. The spin is short
(1,000), so beside a busy neighbour a waiting thread still yields its core soon: with
``bench/contention.py``'s hog, tokens/s with over without was 0.95 at 1,000 spins and 0.30 at 10,000
(torch's default spin: 0.12).

Ordering matters: OpenMP reads its environment once, when its runtime is loaded, i.e. when torch is
first imported. ``prepare_openmp`` must therefore run before anything imports torch — `keepwarm serve`
calls it first thing in its handler (the CLI imports no torch before that); ``apply`` then sets torch's
thread count, which is possible at any time. The parsing functions here are pure and take file
contents, so they are tested on fake ``cpu.max`` files and affinity sets.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
# A bounded spin before sleeping: libgomp counts spins, Intel's runtime milliseconds. Set only when the
# user chose no wait policy of their own (OMP_WAIT_POLICY, or either variable itself).
OPENMP_WAIT_DEFAULTS = {"GOMP_SPINCOUNT": "1000", "KMP_BLOCKTIME": "1"}
WAIT_POLICY = "OMP_WAIT_POLICY"


@dataclass(frozen=True)
class ThreadChoice:
    threads: int  # intra-op threads for torch (>= 1)
    reason: str  # where the number came from, for the log


def parse_cpu_max(text: str) -> float | None:
    """cgroup v2 ``cpu.max`` ("QUOTA PERIOD", QUOTA may be "max") -> CPUs, None when unlimited."""
    fields = text.split()
    if not fields or fields[0] == "max":
        return None
    quota = int(fields[0])
    period = int(fields[1]) if len(fields) > 1 else 100_000
    return quota / period if quota > 0 and period > 0 else None


def parse_cfs(quota_text: str, period_text: str) -> float | None:
    """cgroup v1 ``cpu.cfs_quota_us`` (-1 = unlimited) and ``cpu.cfs_period_us`` -> CPUs or None."""
    quota, period = int(quota_text.strip()), int(period_text.strip())
    return quota / period if quota > 0 and period > 0 else None


def cgroup_paths(proc_self_cgroup: str) -> tuple[str | None, str | None]:
    """(v2 path, v1 cpu-controller path) of this process, from /proc/self/cgroup's text."""
    v2 = v1 = None
    for line in proc_self_cgroup.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "cpu" in controllers.split(","):
            v1 = path
    return v2, v1


def _ancestors(mount: Path, path: str | None) -> list[Path]:
    """The cgroup's directory under ``mount`` and every parent up to the mount itself.

    Inside a container the mount is often the container's own cgroup while /proc/self/cgroup still
    names the host path, which then does not exist: the mount itself is always a candidate."""
    found = [mount]
    if path:
        parts = [p for p in path.strip("/").split("/") if p]
        found += [mount.joinpath(*parts[:i]) for i in range(1, len(parts) + 1)]
    return found


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_self_cgroup: str | None = None) -> float | None:
    """The tightest CPU quota over this process's cgroup and its ancestors (v2 and v1), or None."""
    if proc_self_cgroup is None:
        try:
            proc_self_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            proc_self_cgroup = ""
    v2, v1 = cgroup_paths(proc_self_cgroup)
    limits: list[float] = []
    for mount in (root, root / "unified"):
        for directory in _ancestors(mount, v2):
            limits += _read_limit(lambda d=directory: parse_cpu_max((d / "cpu.max").read_text()))
    for mount in (root / "cpu,cpuacct", root / "cpu"):
        for directory in _ancestors(mount, v1):
            limits += _read_limit(
                lambda d=directory: parse_cfs(
                    (d / "cpu.cfs_quota_us").read_text(), (d / "cpu.cfs_period_us").read_text()
                )
            )
    return min(limits) if limits else None


def _read_limit(read) -> list[float]:
    try:
        limit = read()
    except (OSError, ValueError):  # absent controller file, or contents this kernel writes differently
        return []
    return [] if limit is None else [limit]


def derive_threads(
    affinity: int, quota: float | None, requested: int | None = None, omp_num_threads: str | None = None
) -> ThreadChoice:
    """The thread count and why. Pure: every input is passed in."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--threads must be at least 1, got {requested}")
        return ThreadChoice(requested, "--threads/KEEPWARM_THREADS")
    if omp_num_threads is not None and omp_num_threads.strip():
        try:
            value = int(omp_num_threads.split(",")[0])  # OpenMP allows a per-level list: take the outer
        except ValueError:
            raise ValueError(f"OMP_NUM_THREADS={omp_num_threads!r} is not a thread count") from None
        if value >= 1:
            return ThreadChoice(value, "OMP_NUM_THREADS")
    threads = max(1, affinity)
    reason = f"{affinity} CPUs in the affinity mask"
    if quota is not None and math.floor(quota) < threads:
        threads = max(1, math.floor(quota))
        reason = f"cgroup CPU quota {quota:g} (affinity {affinity} CPUs)"
    return ThreadChoice(threads, reason)


def choose_threads(requested: int | None = None, environ: Mapping[str, str] = os.environ) -> ThreadChoice:
    """``derive_threads`` on this process's affinity mask, cgroup quota and environment."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        affinity = os.cpu_count() or 1
    return derive_threads(affinity, cgroup_cpu_limit(), requested, environ.get("OMP_NUM_THREADS"))


def per_rank(choice: ThreadChoice, ranks: int) -> ThreadChoice:
    """One tensor-parallel rank's share of ``choice``: the ranks of a group share the machine's cores."""
    if ranks <= 1:
        return choice
    return ThreadChoice(max(1, choice.threads // ranks), f"{choice.reason}, shared by {ranks} ranks")


def prepare_openmp(choice: ThreadChoice, environ: MutableMapping[str, str] = os.environ) -> bool:
    """Put the thread count and a bounded-spin wait into the environment OpenMP will read.

    Returns False (and changes nothing that could still matter) when torch is already imported: the
    OpenMP runtime has read its environment by then, and only ``apply`` can still take effect."""
    if "torch" in sys.modules:
        return False
    environ["OMP_NUM_THREADS"] = str(choice.threads)
    if WAIT_POLICY not in environ:  # OMP_WAIT_POLICY=PASSIVE/ACTIVE: the user's, with its own spin
        for name, value in OPENMP_WAIT_DEFAULTS.items():
            environ.setdefault(name, value)
    return True


def apply(choice: ThreadChoice) -> int:
    """Set torch's intra-op thread count; returns what torch reports back."""
    import torch

    torch.set_num_threads(choice.threads)
    return torch.get_num_threads()


def use_threads(choice: ThreadChoice) -> int:
    """Both steps at once, for a process that sets its threads before it imports torch (benchmarks):
    OpenMP's environment, then torch's count; returns what torch reports back."""
    prepare_openmp(choice)
    return apply(choice)
