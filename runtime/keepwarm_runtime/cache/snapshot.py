"""What one cache daemon holds at one moment, as frozen values: ``CacheDaemon.snapshot()``.

The node agent (agent/) and a successor daemon (succession.py) read it in-process, by attribute;
the ``stats`` reply is its ``wire()``, the JSON object whose keys protocol.py documents. A model and
a LoRA adapter are one shape (``kind`` tells them apart), as in that reply; a model that failed to
load is a FailedModel, the shape ``stats`` (under "failed") and ``list`` give it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keepwarm_api.refusals import Refusals
from keepwarm_runtime.cache.fingerprint import WeightCacheKey
from keepwarm_runtime.weights.tensor_parallel import WHOLE, Sharding


@dataclass(frozen=True)
class ModelSnapshot:
    """A resident model or LoRA adapter (registry.ResidentModel) as the daemon serves it."""

    path: Path  # directory it was loaded from
    nbytes: int  # arena size
    key: WeightCacheKey  # what a client's key must equal to attach it
    digest: str  # sha256 of the bytes read
    pinned: bool  # never evicted under the budget
    tier: str  # "host" | "gpu"
    gpu_uuids: tuple[str, ...]  # gpu tier: the GPU holding it; empty on the host tier
    num_tensors: int  # entries in the arena's tensor table
    load_seconds: float  # reading and filling the arena
    hits: int  # clients that attached it
    page_mode: str  # how the arena's pages were obtained (backends)
    kind: str  # adapters.KINDS: "model" or "adapter"
    sharding: Sharding = WHOLE  # the tensor-parallel shard it is (the key's tp_rank/tp_size)

    @property
    def key_digest(self) -> str:
        """Short id of the key, as the status reports it (fingerprint)."""
        return self.key.digest

    def wire(self) -> dict[str, Any]:
        """The entry under "models" in ``stats``."""
        return {
            "path": str(self.path),
            "bytes": self.nbytes,
            "fingerprint": self.key.to_dict(),
            "key_digest": self.key_digest,
            "digest": self.digest,
            "pinned": self.pinned,
            "tier": self.tier,
            "gpu_uuids": list(self.gpu_uuids),
            "num_tensors": self.num_tensors,
            "load_seconds": round(self.load_seconds, 4),
            "hits": self.hits,
            "page_mode": self.page_mode,
            "state": "Resident",
            "kind": self.kind,
        }


@dataclass(frozen=True)
class FailedModel:
    path: Path  # checkpoint directory
    reason: str  # names the file and what is wrong with it

    def wire(self) -> dict[str, Any]:
        """Shape of a Failed model in ``stats`` (under "failed") and ``list``: stable, documented."""
        return {"state": "Failed", "path": str(self.path), "reason": self.reason}


@dataclass(frozen=True)
class DaemonSnapshot:
    """One daemon: its settings, what it holds, what failed, whom it refused."""

    version: str  # keepwarm version of the daemon
    pid: int
    tier: str  # "host" | "gpu" (never "auto": resolved at start)
    socket: Path  # the socket it serves
    dtype: str  # serving dtype of floating tensors
    budget: int | None  # bytes; None: unlimited
    gpu_uuid: str | None  # gpu tier: the GPU its arenas are on
    serves_gpu: str | None  # the GPU whose pods it serves (gpu_uuid, or a fake GPU's UUID)
    models: Mapping[str, ModelSnapshot]  # daemon name -> resident model or adapter
    failed: Mapping[str, FailedModel]  # daemon name -> why it failed to load
    refusals: Refusals | None  # the latest episode of refused peers (security.RefusalLog)

    @property
    def resident_bytes(self) -> int:
        return sum(m.nbytes for m in self.models.values())

    def wire(self) -> dict[str, Any]:
        """The ``stats`` reply (after its "ok"), keys in this order."""
        return {
            "version": self.version,
            "pid": self.pid,
            "tier": self.tier,
            "socket": str(self.socket),
            "dtype": self.dtype,
            "budget": self.budget,
            "resident_bytes": self.resident_bytes,
            "gpu_uuid": self.gpu_uuid,
            "serves_gpu": self.serves_gpu,
            "models": {name: m.wire() for name, m in self.models.items()},
            "failed": {name: f.wire() for name, f in self.failed.items()},
            "refusals": None if self.refusals is None else self.refusals.wire(),
        }
