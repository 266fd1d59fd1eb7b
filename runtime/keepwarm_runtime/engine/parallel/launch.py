"""Starting the ranks of a tensor-parallel group.

``rank_config``: one rank's EngineConfig (its rank, the group's rendezvous, its device: ``cuda``
becomes ``cuda:<rank>``, its place on the node). ``rendezvous``: a fresh ``file://`` path in a private
directory, one per group start; ``node_rendezvous``: rank 0's TCP store, for a group over several
nodes, each running its ``NodeShare`` of the ranks. An offline ``LLM(..., tensor_parallel_size=N)``
is rank 0 itself and starts ranks 1..N-1 as child processes (``RankProcesses``: ``python -m
keepwarm_runtime.engine.parallel.launch``, the rank's config as JSON on stdin, never pickled); each
builds its engine and follows rank 0's steps (engine/parallel/runner.py), and dies with its parent.
`keepwarm serve` forks its ranks from the supervising parent instead (server/supervisor.py), with the
same ``rank_config``.

On CPU the ranks share the cores: each uses its share of the intra-op threads (``share_threads``).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from keepwarm_runtime.engine.config import EngineConfig

log = logging.getLogger(__name__)

STOP_WAIT_S = 10.0  # a rank told to stop exits within this, or is killed
_PR_SET_PDEATHSIG = 1


def rendezvous(directory: str | Path | None = None) -> str:
    """A fresh ``file://`` rendezvous in a new private directory (under ``directory`` if given)."""
    path = Path(tempfile.mkdtemp(prefix="keepwarm-tp-", dir=directory)) / "rendezvous"
    return f"file://{path}"


def device_refusal(device: str, ranks: int) -> str | None:
    """Why a group of ``ranks`` cannot run on ``device`` (None: it can): its ranks take cuda:0,
    cuda:1, ... of the GPUs the process sees, so a group names no GPU of its own."""
    if ranks > 1 and device.startswith("cuda") and device not in ("cuda", "cuda:0"):
        return (
            f"device {device!r}: a tensor-parallel group of {ranks} takes cuda:0, cuda:1, ... of the GPUs "
            "this process sees (CUDA_VISIBLE_DEVICES chooses them); use device 'cuda'"
        )
    return None


@dataclass(frozen=True)
class NodeShare:
    """The ranks of a group of ``size`` that run on node ``node_rank`` of ``nnodes`` (a pod of a
    LeaderWorkerSet): ``local`` consecutive ranks from ``first``. Node 0 holds rank 0, which serves."""

    size: int
    nnodes: int = 1
    node_rank: int = 0

    @property
    def local(self) -> int:
        return self.size // self.nnodes

    @property
    def first(self) -> int:
        return self.node_rank * self.local

    @property
    def serves(self) -> bool:
        return self.node_rank == 0

    def refusal(self, master_addr: str | None) -> str | None:
        """Why this share cannot run (None: it can)."""
        if self.nnodes == 1:
            return None if self.node_rank == 0 else f"--node-rank {self.node_rank} needs --nnodes above it"
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            return f"--node-rank {self.node_rank} is not a node of --nnodes {self.nnodes} (0 .. nnodes - 1)"
        if self.size % self.nnodes != 0 or self.size == self.nnodes == 1:
            return (
                f"--tensor-parallel-size {self.size} does not split over --nnodes {self.nnodes}: each node "
                "runs the same number of ranks"
            )
        if not master_addr:
            return f"--nnodes {self.nnodes} needs --master-addr: node rank 0's address, where the ranks meet"
        return None


def node_rendezvous(master_addr: str, master_port: int) -> str:
    """The rendezvous of a group spanning nodes: rank 0's TCP store on node rank 0."""
    host = f"[{master_addr}]" if ":" in master_addr else master_addr
    return f"tcp://{host}:{master_port}"


def rank_config(
    config: EngineConfig, rank: int, init_method: str, local_rank: int | None = None
) -> EngineConfig:
    """The EngineConfig of rank ``rank`` of ``config``'s group (ValueError: ``device_refusal``); on
    CUDA it takes ``cuda:<local_rank>`` (its place on this node; the rank itself by default)."""
    device = config.device
    if (refusal := device_refusal(device, config.tensor_parallel_size)) is not None:
        raise ValueError(refusal)
    if config.tensor_parallel_size > 1 and device.startswith("cuda"):
        device = f"cuda:{rank if local_rank is None else local_rank}"
    return replace(config, tensor_parallel_rank=rank, distributed_init_method=init_method, device=device)


def refuse_unsplittable(config: EngineConfig) -> None:
    """ModelLoadError, naming the layer, when ``config``'s model cannot be split over its ranks: rank
    0's arena is planned (checkpoint headers and a meta-device model, no weights: FP8 block
    boundaries included) before any rank process starts; each rank's attach plans its own again."""
    from keepwarm_runtime.engine.loader import ModelLoadError
    from keepwarm_runtime.engine.prefetch import attach_request
    from keepwarm_runtime.weights.arena import plan_layout
    from keepwarm_runtime.weights.checkpoint import CheckpointError, parse_dtype, read_checkpoint
    from keepwarm_runtime.weights.tensor_parallel import ShardingError

    try:
        request = attach_request(config)
        shards = read_checkpoint(config.model_dir)
        plan_layout(shards, parse_dtype(config.dtype), request.online, request.expert_layout, config.sharding)
    except ShardingError as exc:
        raise ModelLoadError(str(exc)) from exc
    except (CheckpointError, ValueError):
        return  # not a sharding matter: the loader names what is wrong with the checkpoint


def share_threads(size: int) -> int:
    """Give this rank its share of the CPU's intra-op threads; returns the count it now uses."""
    import torch

    from keepwarm_runtime.engine import threads

    return threads.apply(threads.per_rank(threads.ThreadChoice(torch.get_num_threads(), "torch's"), size))


def to_json(config: EngineConfig) -> str:
    return json.dumps({f.name: _plain(getattr(config, f.name)) for f in fields(config)})


def from_json(text: str) -> EngineConfig:
    data = json.loads(text)
    for f in fields(EngineConfig):
        if f.name in data and isinstance(data[f.name], list):
            data[f.name] = frozenset(data[f.name]) if "frozenset" in str(f.type) else tuple(data[f.name])
    return EngineConfig(**data)


def _plain(value: Any) -> Any:
    return (
        sorted(value) if isinstance(value, frozenset) else list(value) if isinstance(value, tuple) else value
    )


class RankProcesses:
    """Ranks 1..N-1 of an offline LLM's group, as child processes of rank 0."""

    def __init__(self, config: EngineConfig) -> None:
        self.init_method = rendezvous()
        self.config = rank_config(config, 0, self.init_method)  # rank 0's: this process
        self.procs: list[subprocess.Popen] = []
        for rank in range(1, config.tensor_parallel_size):
            proc = subprocess.Popen(
                [sys.executable, "-m", "keepwarm_runtime.engine.parallel.launch"],
                stdin=subprocess.PIPE,
                start_new_session=False,
            )
            assert proc.stdin is not None
            proc.stdin.write(to_json(rank_config(config, rank, self.init_method)).encode())
            proc.stdin.close()
            self.procs.append(proc)

    def stop(self, told: bool) -> None:
        """Wait for the ranks (``told``: rank 0 sent them stop) and kill what is left; remove the
        rendezvous directory."""
        deadline = time.monotonic() + (STOP_WAIT_S if told else 0.0)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        path = Path(self.init_method.removeprefix("file://"))
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
            path.parent.rmdir()


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this rank when its parent (rank 0, or the supervising parent) dies."""
    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def serve_rank(config: EngineConfig, prefetch=None) -> int:
    """A rank 1..N-1: build the engine (its shard, attention, KV cache), then follow rank 0's steps.
    Returns the exit code: 0 when rank 0 said stop, 1 when the engine or the group failed."""
    from keepwarm_runtime.engine.llm_engine import LLMEngine
    from keepwarm_runtime.engine.parallel.runner import follow

    for sig in (signal.SIGINT, signal.SIGTERM):  # rank 0 drains first; its parent stops this rank after
        signal.signal(sig, signal.SIG_IGN)
    try:
        engine = LLMEngine(config, prefetch=prefetch)
        follow(engine)
    except Exception:
        log.exception("tensor-parallel rank %d failed", config.tensor_parallel_rank)
        return 1
    return 0


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    die_with_parent()
    config = from_json(sys.stdin.read())
    if config.device == "cpu":
        share_threads(config.tensor_parallel_size)
    return serve_rank(config)


if __name__ == "__main__":
    sys.exit(main())
