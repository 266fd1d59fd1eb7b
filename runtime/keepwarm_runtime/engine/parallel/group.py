"""The process group of a tensor-parallel engine, joined by every rank before its weights load.

Backends: gloo on CPU; on CUDA one group with two (``cpu:gloo,cuda:nccl``), so the step inputs rank 0
broadcasts travel as CPU tensors over gloo and the activations over NCCL. The rendezvous is the
EngineConfig's ``distributed_init_method``: ``file://PATH`` for ranks on one machine (a fresh path per
group start, made by whoever starts the ranks: no port to pick or race for), ``tcp://HOST:PORT`` across
machines (rank 0 holds the store; the others wait for HOST to resolve, as a pod's DNS name may appear
after they start). Every collective runs on torch.distributed's default group: a process belongs to one group.

Timeouts: the ranks must all have joined within ``JOIN_TIMEOUT`` (the rendezvous store's: a rank
that died before joining fails the others' start instead of holding it); after that, ranks 1..N-1 wait
for rank 0's next step for as long as the server stays idle, so the group's collectives time out only
after ``GROUP_TIMEOUT``; a rank that dies is seen at once (its peers' sockets close and the collective
raises), which is what restarts a group. A rank that hangs alive stalls its group until then
(documented in docs/parallel.md).
"""

from __future__ import annotations

import logging
import socket
import time
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from keepwarm_runtime.engine.config import EngineConfig

log = logging.getLogger(__name__)

GROUP_TIMEOUT = timedelta(days=7)
JOIN_TIMEOUT = timedelta(minutes=10)  # every rank's process start and imports, on a busy node


class GroupError(RuntimeError):
    """The ranks of a group disagree or cannot meet; the message says which and how."""


def backend_for(device: torch.device) -> str:
    return "gloo" if device.type == "cpu" else "cpu:gloo,cuda:nccl"


def join(config: EngineConfig) -> bool:
    """Join ``config``'s group as its rank (a no-op for one rank without a rendezvous); True when this
    process runs as a rank of a group. A rendezvous with one rank makes a group of one: every
    collective of the parallel path runs, over one process (the GPU check's NCCL step)."""
    size = config.tensor_parallel_size
    if size == 1 and config.distributed_init_method is None:
        return False
    if config.distributed_init_method is None:
        raise GroupError(
            f"tensor_parallel_size {size} needs a rendezvous (distributed_init_method): start the ranks "
            "through LLM(...) or keepwarm serve, which make one"
        )
    if dist.is_initialized():
        if dist.get_world_size() != size or dist.get_rank() != config.tensor_parallel_rank:
            raise GroupError(
                f"this process is already rank {dist.get_rank()} of {dist.get_world_size()}; it cannot "
                f"also be rank {config.tensor_parallel_rank} of {size}"
            )
        return True
    device = torch.device(config.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rank_ = config.tensor_parallel_rank
    store = rendezvous_store(config.distributed_init_method, rank_, size)
    dist.init_process_group(
        backend_for(device), store=store, rank=rank_, world_size=size, timeout=GROUP_TIMEOUT
    )
    log.info(
        "joined the tensor-parallel group as rank %d of %d (%s)", dist.get_rank(), size, backend_for(device)
    )
    return True


def rendezvous_store(init_method: str, rank: int, size: int) -> dist.Store:
    """The store the ranks meet at: a file (``file://PATH``) or rank 0's TCP store
    (``tcp://HOST:PORT``), waiting at most JOIN_TIMEOUT for the others."""
    if init_method.startswith("file://"):
        store = dist.FileStore(init_method.removeprefix("file://"), size)
        store.set_timeout(JOIN_TIMEOUT)
        return store
    if init_method.startswith("tcp://"):
        host, _, port = init_method.removeprefix("tcp://").rpartition(":")
        host = host.removeprefix("[").removesuffix("]")
        if rank > 0:  # node rank 0's name (a pod's DNS record) may appear only after this rank starts
            wait_resolvable(host, time.monotonic() + JOIN_TIMEOUT.total_seconds())
        return dist.TCPStore(host, int(port), size, rank == 0, timeout=JOIN_TIMEOUT)
    raise GroupError(f"distributed_init_method {init_method!r}: use file://PATH or tcp://HOST:PORT")


def wait_resolvable(host: str, deadline: float, pause_s: float = 0.5) -> None:
    """Return once ``host`` resolves; GroupError naming it at ``deadline``."""
    while True:
        try:
            socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
            return
        except socket.gaierror as exc:
            if time.monotonic() >= deadline:
                raise GroupError(f"the group's meeting address {host!r} did not resolve: {exc}") from exc
            time.sleep(pause_s)


def leave() -> None:
    """Leave the group (an engine's end); a no-op outside one."""
    if dist.is_initialized():
        dist.destroy_process_group()


def active() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def fewest(count: int) -> int:
    """The smallest of every rank's ``count`` (KV blocks: each rank sized its own memory)."""
    if not active():
        return count
    value = torch.tensor([count], dtype=torch.int64)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return int(value.item())


def every_rank(text: str, width: int = 64) -> list[str]:
    """Each rank's ``text`` (ASCII, at most ``width`` characters), in rank order."""
    if not active():
        return [text]
    data = text.encode("ascii")[:width].ljust(width, b"\0")
    mine = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = [torch.empty(width, dtype=torch.uint8) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return [bytes(t.tolist()).rstrip(b"\0").decode("ascii") for t in gathered]


def check_same_checkpoint(files: str | None, source: str) -> None:
    """Every rank attached the same checkpoint (its files' identity hash), else GroupError naming
    each rank's: a group never serves shards of two checkpoints (one rewritten between two ranks'
    reads, or a daemon's older arena beside a disk read)."""
    seen = every_rank(f"{(files or '?')[:16]} {source}")
    if len({entry.split()[0] for entry in seen}) > 1:
        raise GroupError(
            "the ranks attached different checkpoints (files hash, source by rank: "
            + "; ".join(f"rank {r}: {entry}" for r, entry in enumerate(seen))
            + "); restart the group once the checkpoint stops changing"
        )
