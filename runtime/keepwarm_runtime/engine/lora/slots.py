"""A fixed pool of adapter slots on the device, and the batched low-rank update every step applies.

Each targetable projection of the base gets a forward hook. Its adapters live stacked: A as
[max_loras * max_rank, in] and B as [out, max_loras * max_rank], slot s owning rows (columns)
s*R .. s*R+r for an adapter of rank r (the columns above r are never gathered; A rows are zero for
modules it does not target). A step
hands every token a slot (-1: the base model, no update). For the tokens x of one projection the
update is ``((x A^T) * mask) B^T * scale`` over the step's active columns only (the ranks of the
adapters this step uses, gathered once and reused while that set is unchanged): the mask keeps each
token's own slot's columns, so one batch mixes any adapters and the base in two dense matmuls, torch
ops only (CPU and GPU). The order of operations is PEFT's, ``lora_B(lora_A(x)) * scaling``, so fp32
results match it to rounding.

Registered adapters stay on the host (engine/lora/adapter.py checked them; attached from the node cache,
they are read-only views of its arena, which slots only ever copy from); a slot holds a copy on
the device while some sequence uses it, and afterwards until the least recently used unpinned slot
is needed for another adapter. A sequence whose adapter finds no slot waits (engine/scheduler.py).
"""

from __future__ import annotations

import contextlib
import itertools
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from keepwarm_runtime.engine.lora.adapter import AdapterCache, LoraLoadError, LoraWeights, load_adapter


class LoraInUse(RuntimeError):
    """The adapter serves running requests; it cannot be removed now."""


@dataclass
class _Step:
    """One step's per-token selection: the columns each token keeps and the scaling it applies."""

    columns: torch.Tensor  # [C] the stacked columns of the adapters this step uses (their ranks only)
    key: tuple  # which adapters those columns hold (slot, load generation): equal keys, equal columns
    mask: torch.Tensor  # [T, C], 1 on the token's slot's columns
    scale: torch.Tensor  # [T, 1], 0 for base tokens


_current: _Step | None = None


@contextlib.contextmanager
def use_step(step: _Step | None) -> Iterator[None]:
    global _current
    previous, _current = _current, step
    try:
        yield
    finally:
        _current = previous


class _Stacked:
    """One projection's slots: A [S*R, in] and B [out, S*R], allocated when an adapter first targets it."""

    def __init__(self, linear: nn.Linear, columns: int):
        w = linear.weight
        self.a = torch.zeros(columns, linear.in_features, dtype=w.dtype, device=w.device)
        self.b = torch.zeros(linear.out_features, columns, dtype=w.dtype, device=w.device)
        self._key: tuple | None = None  # the active columns gathered below are for this step key
        self._a_active, self._b_active = self.a, self.b

    def hook(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        step = _current
        if step is None:
            return output
        x = args[0].reshape(-1, self.a.shape[1])
        if x.shape[0] != step.mask.shape[0]:  # a projection run on some tokens only: slots would misalign
            raise RuntimeError(
                f"LoRA: a targeted projection saw {x.shape[0]} tokens, the step has {step.mask.shape[0]}"
            )
        if step.key != self._key:
            self._a_active = self.a.index_select(0, step.columns)
            self._b_active = self.b.index_select(1, step.columns)
            self._key = step.key
        update = ((x @ self._a_active.T) * step.mask) @ self._b_active.T * step.scale
        return output + update.reshape(output.shape)


class LoraSlots:
    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, cache: AdapterCache | None = None):
        """``cache``: read adapters through the node cache (engine/lora/adapter.py); None: from disk."""
        self.model = model
        self.cache = cache
        self.max_loras, self.max_rank = max_loras, max_rank
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.adapters: dict[str, LoraWeights] = {}  # registered, on the host
        self.ids: dict[str, int] = {}  # name -> identity of this registration (salts prefix-cache hashes)
        self.resident: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recently used first
        self.pins: dict[str, int] = {}  # name -> running sequences using it
        self.scaling = torch.zeros(max_loras, dtype=torch.float32)
        self.generation = [0] * max_loras  # bumped whenever a slot is (re)loaded
        self.ranks = [0] * max_loras
        self._stacked: dict[str, _Stacked] = {}
        self._modules = dict(model.named_modules())  # what adapters may target, looked up per load
        self._next_id = itertools.count(1)

    # -- registration (host) ---------------------------------------------------------------------

    def add(self, name: str, path: str | Path) -> LoraWeights:
        """Read, check and register an adapter; LoraLoadError names what is wrong, changing nothing."""
        return self.register(self.read(name, path))

    def read(self, name: str, path: str | Path) -> LoraWeights:
        """Read and check an adapter, changing nothing here: safe beside running steps (it reads only
        the base's module shapes), so a server reads outside the engine thread and only registers in it."""
        if name in self.adapters:
            raise LoraLoadError(f"adapter {name!r} is already loaded")
        return load_adapter(name, path, self.model, self.max_rank, self.dtype, self.cache, self._modules)

    def register(self, weights: LoraWeights) -> LoraWeights:
        """Make a read adapter selectable (between steps): hooks its projections, slots it on first use."""
        name = weights.name
        if name in self.adapters:
            raise LoraLoadError(f"adapter {name!r} is already loaded")
        for module_name in weights.modules:  # checked above: every one is a targetable nn.Linear
            if module_name not in self._stacked:
                linear = self._modules[module_name]
                stacked = self._stacked[module_name] = _Stacked(linear, self.max_loras * self.max_rank)
                linear.register_forward_hook(stacked.hook)
        self.adapters[name] = weights
        self.ids[name] = next(self._next_id)
        return weights

    def remove(self, name: str) -> None:
        """Forget an adapter; LoraInUse while a running sequence uses it, KeyError if it is unknown."""
        if name not in self.adapters:
            raise KeyError(name)
        if self.pins.get(name):
            raise LoraInUse(f"adapter {name!r} is in use by {self.pins[name]} running sequences")
        self.resident.pop(name, None)
        del self.adapters[name], self.ids[name]

    # -- slots (device) --------------------------------------------------------------------------

    def acquire(self, name: str) -> bool:
        """Pin ``name`` in a slot for one sequence, loading it (evicting the least recently used
        unpinned adapter) if needed; False when every slot is pinned by other adapters."""
        if name not in self.resident:
            slot = self._free_slot()
            if slot is None:
                return False
            self._load(name, slot)
        self.resident.move_to_end(name)
        self.pins[name] = self.pins.get(name, 0) + 1
        return True

    def release(self, name: str) -> None:
        self.pins[name] -= 1
        if not self.pins[name]:
            del self.pins[name]

    def slot(self, name: str | None) -> int:
        return -1 if name is None else self.resident[name]

    def step(self, token_slots: list[int]) -> _Step | None:
        """The step's per-token selection; None when no token uses an adapter (no update at all)."""
        active = sorted({s for s in token_slots if s >= 0})
        if not active:
            return None
        owner = [s for s in active for _ in range(self.ranks[s])]  # the slot of each active column
        columns = [s * self.max_rank + i for s in active for i in range(self.ranks[s])]
        slots = torch.tensor(token_slots, dtype=torch.long)
        mask = (slots[:, None] == torch.tensor(owner)[None, :]).to(self.dtype)
        scale = torch.where(slots < 0, 0.0, self.scaling[slots.clamp(min=0)]).to(self.dtype)[:, None]
        key = tuple((s, self.generation[s]) for s in active)
        dev = self.device
        return _Step(torch.tensor(columns, device=dev), key, mask.to(dev), scale.to(dev))

    def _free_slot(self) -> int | None:
        used = set(self.resident.values())
        free = next((s for s in range(self.max_loras) if s not in used), None)
        if free is not None:
            return free
        victim = next((n for n in self.resident if not self.pins.get(n)), None)
        return None if victim is None else self.resident.pop(victim)

    def _load(self, name: str, slot: int) -> None:
        """Copy ``name`` into ``slot``: its rank's rows of every stacked projection (a step gathers
        no column above a slot's rank, so whatever an earlier occupant left there is never read);
        projections it does not target get zero A rows, so they add nothing (B stays finite)."""
        weights = self.adapters[name]
        lo, hi = slot * self.max_rank, slot * self.max_rank + weights.rank
        targets, sources, untargeted = [], [], []
        for module_name, stacked in self._stacked.items():
            pair = weights.modules.get(module_name)
            if pair is None:
                untargeted.append(stacked.a[lo:hi])
            else:
                targets += (stacked.a[lo:hi], stacked.b[:, lo:hi])
                sources += pair
        # One fused call each instead of a copy per projection: hundreds of them on a deep model.
        torch._foreach_copy_(targets, sources)
        if untargeted:
            torch._foreach_zero_(untargeted)
        self.scaling[slot] = weights.scaling
        self.ranks[slot] = weights.rank
        self.generation[slot] += 1
        self.resident[name] = slot
