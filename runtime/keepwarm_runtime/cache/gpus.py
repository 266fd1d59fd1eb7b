"""Which daemons `keepwarm cache serve` runs: the one it always ran, one per GPU, or one per fake GPU.

An inference pod attaches the socket of the GPU it was given (cache.client.socket_path_for:
gpu-<UUID>.sock, else host.sock), so a node agent on the gpu tier must serve every GPU of its node,
not only --device. With ``--all-gpus`` the process discovers the GPUs it sees through the CUDA driver
(the same calls that name a daemon's socket, backends/cuda.py) and runs one daemon per GPU, each with
its --device; the host tier keeps its one host.sock, which serves pods on any GPU.

``--fake-gpu`` (repeated; KEEPWARM_CACHE_FAKE_GPUS) is a test/dev setting: it declares GPU UUIDs
instead of discovering them and runs one daemon per fake GPU, host-memory backed but served on
gpu-<UUID>.sock, so the per-GPU agent and its status can run (and be tested end to end) on a machine
without CUDA. It stands in for the gpu tier only: it is refused with --tier host (whose one daemon
serves all GPUs), and so is --all-gpus.

A model held as tensor-parallel shards (``--tensor-parallel-size``, a WeightCache model's parallelism)
puts one shard per GPU (``held_ranks``) or, on the host tier, every shard in the one daemon.

The planning (plan_daemons, held_ranks) is pure; discover() is the one side effect.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# What a UUID may look like on the command line: it names a socket file, so no slashes or dots.
UUID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,99}$")


class GPUPlanError(ValueError):
    """A GPU setting that cannot apply (named in the message)."""


@dataclass(frozen=True)
class GPU:
    ordinal: int  # CUDA device index in this process (the daemon's --device cuda:<ordinal>)
    uuid: str  # GPU-xxxxxxxx-... as nvidia-smi prints it


@dataclass(frozen=True)
class DaemonPlan:
    tier: str  # "gpu" | "host": where the arenas live
    device: str | None  # gpu tier: the daemon's --device; None keeps the configured one
    fake_gpu_uuid: str | None = None  # twin: host arenas served on gpu-<uuid>.sock


def fake_gpu_uuid(text: str) -> str:
    """One --fake-gpus entry, checked: it becomes part of a socket file name."""
    value = text.strip()
    if not UUID_PATTERN.match(value):
        raise ValueError(f"fake GPU UUID {text!r}: use letters, digits and '-' (e.g. GPU-fake-0)")
    return value


def plan_daemons(
    tier: str, all_gpus: bool, fake_gpus: Sequence[str], discover: Callable[[], list[GPU]]
) -> list[DaemonPlan]:
    """The daemons to run, from the configured tier (auto, gpu or host) and the two GPU settings.

    Neither setting: one daemon as configured (its --device on the gpu tier). ``fake_gpus``: one
    host-backed twin per UUID (implies --all-gpus). ``all_gpus``: one daemon per discovered GPU; with
    none, tier auto falls back to the one host daemon (as the daemon's own auto does) and tier gpu is
    refused by name.
    """
    if fake_gpus:
        if tier == "host":
            raise GPUPlanError("--fake-gpu stands in for the gpu tier's per-GPU daemons; --tier host has one")
        duplicates = sorted({u for u in fake_gpus if list(fake_gpus).count(u) > 1})
        if duplicates:
            raise GPUPlanError(f"--fake-gpu names {', '.join(duplicates)} more than once")
        return [DaemonPlan("host", None, u) for u in fake_gpus]
    if not all_gpus:
        return [DaemonPlan(tier, None)]
    if tier == "host":
        raise GPUPlanError("--all-gpus applies to the gpu tier; --tier host has one daemon for every GPU")
    gpus = discover()
    if not gpus and tier == "auto":
        return [DaemonPlan("host", None)]
    if not gpus:
        raise GPUPlanError("--all-gpus: this process sees no GPU (check NVIDIA_VISIBLE_DEVICES)")
    return [DaemonPlan("gpu", f"cuda:{g.ordinal}") for g in sorted(gpus, key=lambda g: g.ordinal)]


def discover() -> list[GPU]:
    """The GPUs this process sees, by ordinal and UUID, from the CUDA driver (none without one)."""
    from keepwarm_runtime.cache.backends import cuda

    try:
        count = cuda.device_count()
    except cuda.CudaError:  # no libcuda.so.1, or cuInit found no device
        return []
    return [GPU(i, cuda.gpu_uuid(i)) for i in range(count)]


def held_ranks(daemon_index: int, daemons: int, size: int) -> list[int]:
    """The tensor-parallel ranks of a model of ``size`` shards that the ``daemon_index``-th of a node's
    ``daemons`` holds: every rank in the one daemon (the host tier's, which serves every GPU); with a
    daemon per GPU, rank ``daemon_index mod size``, so a pod whose ranks sit on consecutive GPUs finds
    each rank's shard on its own GPU."""
    if daemons == 1:
        return list(range(size))
    return [daemon_index % size]
