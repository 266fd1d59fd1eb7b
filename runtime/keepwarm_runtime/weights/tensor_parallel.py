"""Tensor- and expert-parallel shards (pure arithmetic): which slice of a tensor a rank holds.

A ``Sharding`` names a process's shard (rank ``rank`` of ``size``, experts partitioned or split); a
``Split`` says how one tensor divides over the ranks (a dimension, equal parts such as ``[gate; up]``
halves split apart, an uneven vocabulary, a bias rank 0 alone holds); ``TensorShard`` turns a source
block placed in the whole tensor into the copies a rank's arena takes. Which split each tensor of a
model gets is ``weights.tensor_parallel_plan``; the arena (weights/arena.py) and the engine's loader
apply it, so the cache daemon and the disk path hold the same slices.

FP8 block scales (``<weight>_scale_inv``) follow their weight in block units (``scaled``,
``in_blocks``), so a split along a block axis must fall on 128-block boundaries; along the experts
it needs nothing. Uneven splits exist only for the vocabulary (``Split.uneven``: ranks hold
ceil(V / size) rows, the last one the rest); every other split that does not divide is a
``ShardingError`` naming the tensor (``check_split``), before any byte is read. ``SHARDING_ID``
names this layout in the cache key's ``conversion``.
"""

from __future__ import annotations

from dataclasses import dataclass

SHARDING_ID = "tp-v1"  # bump when a split below changes
FP8_BLOCK = 128  # a block-scaled weight's block edge along either axis


class ShardingError(ValueError):
    """A model cannot be split over the ranks as asked; the message names the layer and the numbers."""


@dataclass(frozen=True)
class Sharding:
    """Which shard a process holds: rank ``rank`` of ``size`` (one rank: the whole model)."""

    rank: int = 0
    size: int = 1  # ranks in the tensor-parallel group
    expert: bool = False  # experts partitioned over the ranks (expert parallel), not split each

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is not in a group of {self.size}")

    @property
    def sharded(self) -> bool:
        return self.size > 1

    def conversion_suffix(self) -> str:
        """What the cache key's ``conversion`` adds for this shard's layout ("" for the whole model)."""
        if not self.sharded:
            return ""
        return SHARDING_ID + ("-ep" if self.expert else "")


WHOLE = Sharding()  # one rank: the whole model


@dataclass(frozen=True)
class Split:
    """How one tensor is divided over the ranks."""

    dim: int | None = None  # the split dimension; None: every rank holds the whole tensor
    parts: int = 1  # equal segments along dim, each split over the ranks ([gate; up]: 2)
    uneven: bool = False  # ceil(n / size) per rank, the last rank holding the rest (vocabulary rows)
    first_rank_only: bool = False  # a bias summed by an all-reduce: rank 0 holds it, others zeros
    granule: int = 1  # a rank's slice of each segment must be a multiple of this (FP8 blocks, pairs)

    @property
    def replicated(self) -> bool:
        return self.dim is None and not self.first_rank_only


REPLICATED = Split()


def chunks(length: int, split: Split, sharding: Sharding) -> list[tuple[int, int, int]]:
    """This rank's ranges along ``split.dim`` of a dimension of ``length``: (start, stop, local start)."""
    if split.dim is None or not sharding.sharded:
        return [(0, length, 0)]
    segment = length // split.parts
    if split.uneven:
        each = -(-segment // sharding.size)
        start = min(sharding.rank * each, segment)
        spans = [(start, min(start + each, segment))]
    else:
        each = segment // sharding.size
        spans = [(sharding.rank * each, (sharding.rank + 1) * each)]
    out, local = [], 0
    for part in range(split.parts):
        for start, stop in spans:
            out.append((part * segment + start, part * segment + stop, local))
            local += stop - start
    return out


def local_shape(shape: tuple[int, ...], split: Split, sharding: Sharding) -> tuple[int, ...]:
    """The shape this rank holds of a tensor of ``shape``."""
    if split.dim is None or not sharding.sharded:
        return tuple(shape)
    held = sum(stop - start for start, stop, _ in chunks(shape[split.dim], split, sharding))
    return (*shape[: split.dim], held, *shape[split.dim + 1 :])


def pieces(
    split: Split, sharding: Sharding, whole: int, start: int, length: int
) -> list[tuple[int, int, int]]:
    """Where a region [start, start + length) of a dimension of ``whole`` elements, the split one,
    lands in this rank's shard: (offset in the region, offset in the shard, count) per piece; none
    when no part of it is this rank's."""
    out = []
    for c_start, c_stop, local in chunks(whole, split, sharding):
        lo, hi = max(start, c_start), min(start + length, c_stop)
        if lo < hi:
            out.append((lo - start, local + lo - c_start, hi - lo))
    return out


def check_split(name: str, shape: tuple[int, ...], split: Split, sharding: Sharding) -> None:
    """ShardingError naming ``name`` unless ``split`` divides ``shape`` over the ranks."""
    if split.dim is None or not sharding.sharded:
        return
    if split.dim >= len(shape):
        raise ShardingError(f"{name}: shape {tuple(shape)} has no dimension {split.dim} to split")
    length = shape[split.dim]
    if length % split.parts:
        raise ShardingError(
            f"{name}: dimension {split.dim} ({length}) does not hold {split.parts} equal parts"
        )
    segment = length // split.parts
    if split.uneven:
        return
    if segment % sharding.size or (segment // sharding.size) % split.granule:
        unit = f" in whole units of {split.granule}" if split.granule > 1 else ""
        raise ShardingError(
            f"{name}: dimension {split.dim} ({segment}{' per part' if split.parts > 1 else ''}) does not "
            f"divide over {sharding.size} tensor-parallel ranks{unit}"
        )


def scaled(split: Split, ndim: int) -> Split:
    """The split of a weight of ``ndim`` dimensions that carries FP8 block scales: along one of its
    two block axes (the last two), slices of whole 128-blocks only; along a leading one (experts),
    as it was."""
    if split.dim is None or split.dim < ndim - 2:
        return split
    return Split(split.dim, split.parts, False, split.first_rank_only, split.granule * FP8_BLOCK)


def in_blocks(split: Split, ndim: int) -> Split:
    """The split of a weight's ``_scale_inv`` block grid (``ndim`` dimensions, as its weight's), given
    the weight's ``scaled`` split: the same slices, counted in blocks."""
    if split.dim is None or split.dim < ndim - 2:
        return split
    return Split(split.dim, split.parts, False, split.first_rank_only, split.granule // FP8_BLOCK)


@dataclass(frozen=True)
class TensorShard:
    """One arena tensor as a rank holds it: its split and the whole tensor's shape."""

    split: Split
    whole: tuple[int, ...]  # the whole tensor's shape (the arena entry holds local_shape of it)
    sharding: Sharding

    @property
    def shape(self) -> tuple[int, ...]:
        return local_shape(self.whole, self.split, self.sharding)

    def copies(
        self, starts: tuple[int, ...], shape: tuple[int, ...]
    ) -> list[tuple[tuple[slice, ...] | None, tuple[slice, ...]]]:
        """How a source block of ``shape``, placed at ``starts`` in the whole tensor, is written into
        this shard: (source index, shard index) pairs; a source index of None means "write zeros"
        (a bias rank 0 alone holds). Empty when none of it is this rank's."""
        region = tuple(slice(s, s + n) for s, n in zip(starts, shape, strict=True))
        whole = tuple(slice(0, n) for n in shape)
        split = self.split
        if not self.sharding.sharded or split.replicated:
            return [(whole, region)]
        if split.dim is None:  # first_rank_only
            return [(whole if self.sharding.rank == 0 else None, region)]
        d = split.dim
        out = []
        for src_off, dst_off, count in pieces(split, self.sharding, self.whole[d], starts[d], shape[d]):
            src = (*whole[:d], slice(src_off, src_off + count), *whole[d + 1 :])
            dst = (*region[:d], slice(dst_off, dst_off + count), *region[d + 1 :])
            out.append((src, dst))
        return out

    @property
    def whole_here(self) -> bool:
        """This rank holds the whole tensor as stored (replicated, or the bias rank 0 holds)."""
        split = self.split
        return (
            not self.sharding.sharded or split.replicated or (split.dim is None and self.sharding.rank == 0)
        )

    def rows(self) -> tuple[int, int] | None:
        """(start, stop) when this shard is one contiguous run of the whole tensor's rows (dim 0, one
        part), so a rank can view it in place; else None."""
        if self.split.dim != 0 or self.split.parts != 1 or not self.sharding.sharded:
            return None
        (start, stop, _), *_ = chunks(self.whole[0], self.split, self.sharding)
        return start, stop
