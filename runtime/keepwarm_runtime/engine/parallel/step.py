"""Rank 0's step inputs, broadcast to the other ranks of its group as integers (never pickled).

Rank 0 alone schedules, samples and detokenizes; every rank runs the same forward pass on the same
inputs: the packed token ids, their positions, the rows the LM head keeps and the step's
AttentionMetadata. ``StepChannel.send`` broadcasts them before rank 0's forward pass, and the other
ranks' ``receive`` returns them (or None once rank 0 sends ``stop``). A sampled token reaches the other
ranks as the next step's input, so sampling (seeded or not) happens once, on rank 0: every rank
follows one stream by construction.

Wire form, two broadcasts per step from rank 0: a header ``[command, length]`` and ``length`` int64
values: the three tensors, then every AttentionMetadata field but ``backend_metadata`` (each backend
derives that from the rest on the receiving rank), each encoded by its kind: a tensor (dtype code,
rank, shape, values), an int, a bool, None, a list of ints or a list of lists of ints. A field of any
other kind is a TypeError naming it when rank 0 packs it, so the metadata cannot grow a field that
silently never reaches the other ranks.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import torch
import torch.distributed as dist

from keepwarm_runtime.engine.attention.metadata import AttentionMetadata

STEP, STOP = 1, 2  # header commands
_TENSOR, _INT, _BOOL, _NONE, _LIST, _LISTS = range(6)
_DTYPES = (torch.int64, torch.int32, torch.bool)
_SKIPPED = frozenset({"backend_metadata"})  # derived by each backend on the receiving rank

StepInputs = tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]  # ids, positions, meta, keep


def pack(
    ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, keep: torch.Tensor
) -> torch.Tensor:
    """The step's inputs as one int64 CPU tensor."""
    out: list[int] = []
    for tensor in (ids, positions, keep):
        _put(out, "inputs", tensor)
    for f in fields(meta):
        if f.name not in _SKIPPED:
            _put(out, f.name, getattr(meta, f.name))
    return torch.tensor(out, dtype=torch.int64)


def unpack(data: torch.Tensor, device: torch.device) -> StepInputs:
    """``pack``'s inverse; tensors land on ``device``."""
    values = data.tolist()
    at = [0]

    def take() -> Any:
        return _take(values, at, device)

    ids, positions, keep = take(), take(), take()
    meta = AttentionMetadata(**{f.name: take() for f in fields(AttentionMetadata) if f.name not in _SKIPPED})
    if at[0] != len(values):
        raise ValueError(f"step inputs: {len(values) - at[0]} values left over")
    return ids, positions, meta, keep


def _put(out: list[int], name: str, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        if value.dtype not in _DTYPES:
            raise TypeError(f"step input {name}: tensors of {value.dtype} are not sent to other ranks")
        out += [_TENSOR, _DTYPES.index(value.dtype), value.dim(), *value.shape]
        out += value.reshape(-1).to("cpu", torch.int64).tolist()
    elif isinstance(value, bool):
        out += [_BOOL, int(value)]
    elif isinstance(value, int):
        out += [_INT, value]
    elif value is None:
        out.append(_NONE)
    elif isinstance(value, list) and all(isinstance(v, int) for v in value):
        out += [_LIST, len(value), *value]
    elif isinstance(value, list) and all(isinstance(v, list) for v in value):
        out += [_LISTS, len(value), *(len(v) for v in value)]
        out += [x for v in value for x in v]
    else:
        raise TypeError(f"step input {name}: a {type(value).__name__} is not sent to other ranks")


def _take(values: list[int], at: list[int], device: torch.device) -> Any:
    def next_values(n: int) -> list[int]:
        start = at[0]
        at[0] += n
        return values[start : at[0]]

    (kind,) = next_values(1)
    if kind == _TENSOR:
        dtype_code, ndim = next_values(2)
        shape = next_values(ndim)
        count = 1
        for d in shape:
            count *= d
        data = torch.tensor(next_values(count), dtype=torch.int64).view(shape)
        return data.to(device=device, dtype=_DTYPES[dtype_code])
    if kind in (_INT, _BOOL):
        (value,) = next_values(1)
        return bool(value) if kind == _BOOL else value
    if kind == _NONE:
        return None
    (n,) = next_values(1)
    if kind == _LIST:
        return next_values(n)
    lengths = next_values(n)
    return [next_values(length) for length in lengths]


class StepChannel:
    """Rank 0 sends each step's inputs; ranks 1..N-1 receive them (gloo broadcasts from rank 0)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device  # where received tensors go

    def send(self, inputs: StepInputs) -> None:
        payload = pack(*inputs)
        dist.broadcast(torch.tensor([STEP, payload.numel()], dtype=torch.int64), src=0)
        dist.broadcast(payload, src=0)

    def stop(self) -> None:
        """Tell the other ranks the engine is done (they leave their loop)."""
        dist.broadcast(torch.tensor([STOP, 0], dtype=torch.int64), src=0)

    def receive(self) -> StepInputs | None:
        header = torch.empty(2, dtype=torch.int64)
        dist.broadcast(header, src=0)
        command, length = header.tolist()
        if command == STOP:
            return None
        if command != STEP:
            raise ValueError(f"unknown step command {command} from rank 0")
        payload = torch.empty(length, dtype=torch.int64)
        dist.broadcast(payload, src=0)
        return unpack(payload, self.device)
