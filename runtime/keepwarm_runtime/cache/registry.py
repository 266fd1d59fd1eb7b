"""The daemon's resident models: lookup by fingerprint, LRU order, budget and pins.

No I/O and no sockets here: the daemon loads an arena, then ``reserve``/``insert`` it; handlers
``lookup`` keys. One lock guards the table, so the node agent's thread and client threads can
call in concurrently.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from keepwarm_runtime.cache.adapters import KIND_MODEL
from keepwarm_runtime.cache.fingerprint import WeightCacheKey
from keepwarm_runtime.cache.metrics import DISK
from keepwarm_runtime.cache.snapshot import ModelSnapshot
from keepwarm_runtime.weights.files import ShardFile
from keepwarm_runtime.weights.tensor_parallel import WHOLE, Sharding

if TYPE_CHECKING:
    from keepwarm_runtime.weights.arena import ArenaLayout


def shard_name(name: str, sharding: Sharding) -> str:
    """A shard's name in the daemon: ``<model>.tp<rank>of<size>`` (``ep`` with expert parallel)."""
    if not sharding.sharded:
        return name
    return f"{name}.{'ep' if sharding.expert else 'tp'}{sharding.rank}of{sharding.size}"


class BudgetExceeded(Exception):
    """A model does not fit in --budget even after evicting every unpinned model."""


class Arena(Protocol):
    size: int
    fd: int
    page_mode: str

    def close(self) -> None: ...


@dataclass
class ResidentModel:
    name: str  # unique within the daemon (directory name, suffixed on clashes)
    path: Path  # checkpoint directory it was loaded from
    key: WeightCacheKey
    tensors: list[list[Any]]  # the arena's tensor table as served (weights.arena.TensorEntry.to_wire rows)
    arena: Arena
    tier: str  # "host" | "gpu"
    digest: str  # sha256 of the bytes read
    pinned: bool
    load_seconds: float
    shards: list[ShardFile]  # headers and file identities as loaded (re-checked before each hit)
    gpu_uuid: str | None = None  # gpu tier: the GPU holding it
    quantization: str | None = None  # online quantization applied at load ("fp8"), kept for reloads
    hits: int = 0
    last_used: float = field(default_factory=time.monotonic)
    origin: str = DISK  # where its arena came from (metrics.ARENA_SOURCES): read here, or handed over
    kind: str = KIND_MODEL  # adapters.KINDS: a model's checkpoint, or a LoRA adapter's (plain layout)
    sharding: Sharding = WHOLE  # a tensor-parallel rank's shard (weights.tensor_parallel), or whole
    filled: ArenaLayout | None = None  # the layout it was filled in here (loading.py); None: adopted
    _parsed: ArenaLayout | None = field(default=None, init=False, repr=False)  # adopted: from `tensors`

    @property
    def nbytes(self) -> int:
        return self.arena.size

    @property
    def layout(self) -> ArenaLayout:
        """The arena's layout in torch's types: as filled here, or for an adopted arena its tensor table
        parsed, which imports torch. Serving never needs it: clients get ``tensors``."""
        if self.filled is not None:
            return self.filled
        if self._parsed is None:
            from keepwarm_runtime.weights.arena import ArenaLayout, TensorEntry

            entries = tuple(TensorEntry.from_wire(row) for row in self.tensors)
            self._parsed = ArenaLayout(entries, max((e.offset + e.nbytes for e in entries), default=0))
        return self._parsed

    def snapshot(self) -> ModelSnapshot:
        """As the daemon's snapshot (and so ``stats``) shows it, now."""
        return ModelSnapshot(
            path=self.path,
            nbytes=self.nbytes,
            key=self.key,
            digest=self.digest,
            pinned=self.pinned,
            tier=self.tier,
            gpu_uuids=(self.gpu_uuid,) if self.gpu_uuid else (),
            num_tensors=len(self.tensors),
            load_seconds=self.load_seconds,
            hits=self.hits,
            page_mode=self.arena.page_mode,
            kind=self.kind,
            sharding=self.sharding,
        )


@dataclass
class Lookup:
    state: str  # "hit" | "mismatch" | "absent"
    model: ResidentModel | None  # the hit, or the nearest model on a mismatch
    fields: list[str]  # mismatch: WeightCacheKey fields that differ
    fd: int = -1  # hit: a dup of the arena fd, owned by the caller


class ModelRegistry:
    def __init__(self, budget: int | None = None) -> None:
        self.budget = budget  # bytes; None = unlimited
        self._models: dict[str, ResidentModel] = {}
        self._lock = threading.RLock()

    def unique_name(self, path: Path, sharding: Sharding = WHOLE) -> str:
        """The name of ``path``'s model (its ``sharding`` shard) if resident, else a new unique one:
        the directory's name, a shard's with its rank (``shard_name``)."""
        base = shard_name(path.resolve().name or "model", sharding)
        with self._lock:
            for model in self._models.values():
                if model.path == path.resolve() and model.sharding == sharding:
                    return model.name
            name, n = base, 1
            while name in self._models:
                n += 1
                name = f"{base}-{n}"
            return name

    def reserve(self, size: int, keep: str | None = None, evict: bool = True) -> list[ResidentModel]:
        """Make room for ``size`` more bytes: evict least-recently-used unpinned models (only when
        ``evict``) until it fits the budget.

        Returns the evicted models (the caller closes their arenas); raises BudgetExceeded, evicting
        nothing, when that would not be enough.
        """
        with self._lock:
            if self.budget is None:
                return []
            used = sum(m.nbytes for m in self._models.values() if m.name != keep)
            if used + size <= self.budget:
                return []
            if not evict:
                raise BudgetExceeded(
                    f"{size} bytes do not fit --budget {self.budget} beside the {used} bytes already "
                    "resident; at start nothing is evicted: raise --budget or load fewer models"
                )
            victims = sorted(
                (m for m in self._models.values() if not m.pinned and m.name != keep),
                key=lambda m: m.last_used,
            )
            freeable = sum(m.nbytes for m in victims)
            if used - freeable + size > self.budget:
                raise BudgetExceeded(
                    f"{size} bytes do not fit --budget {self.budget}: {used - freeable} bytes are pinned "
                    "or in use; raise --budget or unpin a model"
                )
            evicted = []
            for victim in victims:
                if used + size <= self.budget:
                    break
                del self._models[victim.name]
                used -= victim.nbytes
                evicted.append(victim)
            return evicted

    def insert(self, model: ResidentModel) -> None:
        with self._lock:
            self._models[model.name] = model

    def remove(self, name: str, model: ResidentModel | None = None) -> ResidentModel | None:
        """Remove ``name`` (only if it is still ``model``, when given); returns what was removed."""
        with self._lock:
            current = self._models.get(name)
            if current is None or (model is not None and current is not model):
                return None
            return self._models.pop(name)

    def get(self, name: str) -> ResidentModel | None:
        with self._lock:
            return self._models.get(name)

    def lookup(self, key: WeightCacheKey, name_hint: str | None = None) -> Lookup:
        """A hit carries a dup of the arena fd, taken under the lock so that a concurrent eviction
        cannot close it first; a miss names the nearest model and the differing fields.

        The nearest model shares the checkpoint hash (same headers: same weights in other settings,
        other files of one architecture, or the same files changed on disk) or, failing that, the
        requested directory name (same model, other weights).
        """
        with self._lock:
            models = list(self._models.values())
            for model in models:
                if model.key == key:
                    model.hits += 1
                    model.last_used = time.monotonic()
                    return Lookup("hit", model, [], os.dup(model.arena.fd))
            near = [m for m in models if m.key.checkpoint == key.checkpoint]
            near = near or [m for m in models if name_hint and m.path.name == name_hint]
            if not near:
                return Lookup("absent", None, [])
            best = min(near, key=lambda m: len(m.key.diff(key)))
            return Lookup("mismatch", best, best.key.diff(key))

    def models(self) -> list[ResidentModel]:
        with self._lock:
            return list(self._models.values())
