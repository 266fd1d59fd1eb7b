"""Filling an arena from a checkpoint: the daemon's shared one, and a client's private one on a miss.

The daemon reads each tensor's bytes once, hashes them into the content digest as they pass, and
writes them into the arena already converted to the serving dtype and laid out as the engine serves
them (expert merges; see keepwarm_runtime.weights.serving_layout), so clients never convert. The
read path is three small steps per tensor (``read_tensor_bytes`` -> digest -> ``write_serving_tensor``)
so that a conversion step has one place to go. A client that cannot attach fills a private arena from
the same plan (``load_serving_layout``: no digest, tensors written in parallel from a mapping of the
file), so the engine gets the same tensors either way.

Online FP8 quantization (``keepwarm cache serve --quantization fp8``) is one more such step: the
tensors ``engine.quant.fp8_modules.online_targets`` names are staged in the serving dtype (a merged
expert stack until its last expert arrives), then quantized in 128x128 blocks with the engine's own
``quantize_blocks`` into an e4m3 entry plus a float32 ``<name>_scale_inv`` entry (in a private arena
too, so a miss gives the same bits).

A kernel's expert layout (``keepwarm cache serve --expert-layout flashinfer_cutlass``,
``weights.kernel_layout``) is the last step: the tensors ``kernel_layout.layout_targets`` names
(and a checkpoint's FP8 scales beside them) get their [gate; up] halves swapped in the arena once
every expert is written; a tensor quantized online is swapped in its float staging, before
quantization.

A tensor-parallel rank's arena (``plan_layout(..., sharding)``) holds its shard: every entry has the
rank's shape, and each write keeps only the slice the rank holds (weights.tensor_parallel,
``TensorShard.copies``); online quantization quantizes the slice, the kernel layout swaps its halves.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO, Protocol, TypeVar

import torch

from keepwarm_runtime.weights import kernel_layout, serving_layout, tensor_parallel, tensor_parallel_plan
from keepwarm_runtime.weights.checkpoint import (
    CONVERTIBLE,
    CheckpointError,
    Shard,
    TensorRecord,
    dtype_name,
    parse_dtype,
)
from keepwarm_runtime.weights.files import FileIdentity
from keepwarm_runtime.weights.fp8 import E4M3, quantize_blocks
from keepwarm_runtime.weights.huge_pages import huge_anonymous, round_up
from keepwarm_runtime.weights.quantization import SCALE_SUFFIX, Fp8Settings, QuantizationError
from keepwarm_runtime.weights.tensor_parallel import WHOLE, Sharding, ShardingError, TensorShard

ALIGN = 256  # bytes; satisfies every dtype and CUDA's preferred alignment
# A tensor the disk path serves from the file's mapping must start on a cache line: safetensors aligns
# its data to 8 bytes only, and a CPU kernel's 64-byte loads from a weight that starts between lines
# each touch two (the 100M Qwen3's float32 decode step at batch 64: 135-140 ms from such views, 122-126
# ms from the arena, on this project's 2-core AVX-512 VM)
CACHE_LINE = 64
T, R = TypeVar("T"), TypeVar("R")


@dataclass(frozen=True)
class TensorEntry:
    name: str  # checkpoint tensor name
    dtype: torch.dtype  # dtype in the arena (serving dtype for floats)
    shape: tuple[int, ...]
    offset: int  # byte offset in the arena, ALIGN-aligned
    nbytes: int

    def to_wire(self) -> list[Any]:
        return [self.name, dtype_name(self.dtype), list(self.shape), self.offset, self.nbytes]

    @classmethod
    def from_wire(cls, row: list[Any]) -> TensorEntry:
        name, dtype, shape, offset, nbytes = row
        return cls(str(name), parse_dtype(dtype), tuple(int(d) for d in shape), int(offset), int(nbytes))


@dataclass(frozen=True)
class QuantizedEntry:
    """An arena tensor the daemon quantizes online: staged in ``staging`` dtype, then block-quantized."""

    scale: str  # name of its float32 block-scale entry (`<name>_scale_inv`)
    staging: torch.dtype  # the serving dtype it is quantized from (what the engine's disk path holds)
    sources: int  # checkpoint tensors that fill it (experts x projections for a merged stack, else 1)
    block: tuple[int, int]


@dataclass(frozen=True)
class ArenaLayout:
    entries: tuple[TensorEntry, ...]
    size: int  # bytes needed, before page rounding
    placements: dict[str, serving_layout.Placement] = field(default_factory=dict)  # merged sources
    quantized: dict[str, QuantizedEntry] = field(default_factory=dict)  # online FP8, by entry name
    up_first: frozenset[str] = frozenset()  # entries converted to the kernel layout ([up; gate])
    # a tensor-parallel rank's arena (weights.tensor_parallel): the entries it holds a slice of
    shards: dict[str, TensorShard] = field(default_factory=dict)


@dataclass(frozen=True)
class _Served:
    name: str  # arena name (checkpoint name, or a merged target's name)
    shape: tuple[int, ...]
    dtype: torch.dtype  # serving dtype
    sources: int


def tensor_serving_dtype(name: str, stored: torch.dtype, serving: torch.dtype) -> torch.dtype:
    """Floats follow the serving dtype, except FP8 block scales (kept float32)."""
    return serving_layout.tensor_dtype(name, stored, serving, CONVERTIBLE)


def plan_layout(
    shards: list[Shard],
    serving: torch.dtype,
    quantization: Fp8Settings | None = None,
    expert_layout: str = kernel_layout.MODEL,
    sharding: Sharding = WHOLE,
) -> ArenaLayout:
    """Where each served tensor lies in the arena; ``quantization`` (online FP8) adds the conversion
    of every linear weight and expert stack to e4m3 plus block scales (QuantizationError if the
    model cannot be built to tell which those are); ``expert_layout`` the kernel layout's swap;
    ``sharding`` one tensor-parallel rank's slice of every tensor (ShardingError, naming the tensor,
    where the model does not divide)."""
    records = [(rec.name, rec.shape, rec.dtype) for shard in shards for rec in shard.tensors]
    model_dir = shards[0].path.parent if shards else None
    model = serving_layout.meta_model(model_dir) if model_dir is not None else None
    conversion = serving_layout.plan(records, serving_layout.merge_rules(model))
    served = _served_tensors(records, conversion, serving)
    served, tensor_shards = _sharded(served, conversion, model, sharding, model_dir)
    quantized = {} if quantization is None else _online_quantized(served, model, quantization, model_dir)
    up_first = _up_first_entries(served, model, expert_layout, model_dir)
    placed: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    for t in served:
        q = quantized.get(t.name)
        placed.append((t.name, E4M3 if q else t.dtype, t.shape))
        if q:
            placed.append((q.scale, torch.float32, (*t.shape[:-2], *_grid(t.shape, q.block))))
    entries, size = pack_entries(placed)
    return ArenaLayout(entries, size, conversion.placements, quantized, up_first, tensor_shards)


def _sharded(
    served: list[_Served],
    conversion: serving_layout.ServingPlan,
    model,
    sharding: Sharding,
    model_dir: Path | None,
) -> tuple[list[_Served], dict[str, TensorShard]]:
    """The served tensors as ``sharding``'s rank holds them (local shapes; a merged target counts only
    the sources that land in its slice), and each one's TensorShard."""
    if not sharding.sharded:
        return served, {}
    if model is None:
        raise ShardingError(
            f"{model_dir}: transformers cannot build this model, so keepwarm cannot tell how to split it "
            "over tensor-parallel ranks"
        )
    plan = tensor_parallel_plan.shard_plan(model, sharding)
    pairs = serving_layout.model_renamings(model)
    block_scaled = tensor_parallel_plan.fp8_weights(t.name for t in served)
    shards: dict[str, TensorShard] = {}
    out = []
    for t in served:
        split = plan.split_of(serving_layout.model_name(t.name, pairs))
        if t.name in block_scaled:
            split = tensor_parallel.scaled(split, len(t.shape))
        elif t.name.endswith(SCALE_SUFFIX):
            split = tensor_parallel.in_blocks(tensor_parallel.scaled(split, len(t.shape)), len(t.shape))
        if t.name[: -len(SCALE_SUFFIX)] not in block_scaled:  # a grid is checked as its weight
            tensor_parallel.check_split(t.name, t.shape, split, sharding)
        shard = TensorShard(split, t.shape, sharding)
        shards[t.name] = shard
        out.append(_Served(t.name, shard.shape, t.dtype, t.sources))
    landing: dict[str, int] = {}
    for placement in conversion.placements.values():
        shard = shards[placement.target]
        rows = placement.rows[1] - placement.rows[0]
        starts, shape = (placement.expert, placement.rows[0], 0), (1, rows, shard.whole[2])
        if shard.copies(starts, shape):
            landing[placement.target] = landing.get(placement.target, 0) + 1
    merged = {p.target for p in conversion.placements.values()}
    return [replace(t, sources=landing.get(t.name, 0)) if t.name in merged else t for t in out], shards


def plain_layout(shards: list[Shard], serving: torch.dtype) -> ArenaLayout:
    """Every tensor as stored, floats in the serving dtype, in file order: no merge, quantization or
    kernel layout (a LoRA adapter's arena, cache/adapters.py)."""
    records = [rec for shard in shards for rec in shard.tensors]
    entries, size = pack_entries(
        [(r.name, tensor_serving_dtype(r.name, r.dtype, serving), r.shape) for r in records]
    )
    return ArenaLayout(entries, size)


def pack_entries(
    tensors: list[tuple[str, torch.dtype, tuple[int, ...]]],
) -> tuple[tuple[TensorEntry, ...], int]:
    """Place (name, dtype, shape) one after another, each ALIGN-aligned; returns entries and size."""
    entries, offset = [], 0
    for name, dtype, shape in tensors:
        nbytes = dtype.itemsize
        for dim in shape:
            nbytes *= dim
        entries.append(TensorEntry(name, dtype, tuple(shape), offset, nbytes))
        offset += round_up(nbytes, ALIGN)
    return tuple(entries), offset


def _grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    return -(-shape[-2] // block[0]), -(-shape[-1] // block[1])


def _served_tensors(records, conversion: serving_layout.ServingPlan, serving: torch.dtype) -> list[_Served]:
    """The arena's tensors in checkpoint order: unmerged ones as stored, merged targets once."""
    targets = {t.name: t for t in conversion.targets}
    sources: dict[str, int] = {}
    for placement in conversion.placements.values():
        sources[placement.target] = sources.get(placement.target, 0) + 1
    served = []
    for name, shape, stored in records:
        placement = conversion.placements.get(name)
        if placement is not None:
            target = targets.pop(placement.target, None)
            if target is None:  # already placed with an earlier source
                continue
            name, shape, stored = target.name, target.shape, target.stored
        dtype = tensor_serving_dtype(name, stored, serving)
        served.append(_Served(name, tuple(shape), dtype, sources.get(name, 1)))
    return served


def _online_quantized(
    served: list[_Served], model, settings: Fp8Settings, model_dir: Path | None
) -> dict[str, QuantizedEntry]:
    """The arena tensors online quantization converts: those whose model name is one of the engine's
    `online_targets`. Every target must be an arena tensor, or the load is refused by name (an engine
    attaching this arena would otherwise find a float weight where it expects e4m3)."""
    from keepwarm_runtime.weights.quantization import online_targets

    if model is None:
        raise QuantizationError(
            f"{model_dir}: transformers cannot build this model, so the cache cannot tell which tensors are "
            "linear weights to quantize online; serve it without --quantization"
        )
    targets = set(online_targets(model, settings))
    pairs = serving_layout.model_renamings(model)
    out: dict[str, QuantizedEntry] = {}
    found: set[str] = set()
    for t in served:
        name = serving_layout.model_name(t.name, pairs)
        if name in targets and t.dtype in CONVERTIBLE and len(t.shape) >= 2:
            out[t.name] = QuantizedEntry(t.name + SCALE_SUFFIX, t.dtype, t.sources, settings.block)
            found.add(name)
    missing = sorted(targets - found)
    if missing:
        raise QuantizationError(
            f"{model_dir}: online fp8 quantization needs {len(missing)} weights the checkpoint does not "
            f"hold as float tensors in the serving layout: {', '.join(missing[:6])}"
        )
    return out


def _up_first_entries(served: list[_Served], model, layout: str, model_dir: Path | None) -> frozenset[str]:
    """Arena tensors `layout` converts: those whose model name is one of `kernel_layout.layout_targets`,
    and a checkpoint's FP8 scales beside them. Every target must be an arena tensor with halves to
    swap, or the load is refused by name (a client asking for the layout would misread it)."""
    targets = set(kernel_layout.layout_targets(model, layout)) if model is not None else set()
    if not targets:
        return frozenset()
    pairs = serving_layout.model_renamings(model)
    names = {t.name: t for t in served}
    chosen: set[str] = set()
    found: set[str] = set()
    for t in served:
        name = serving_layout.model_name(t.name, pairs)
        if name in targets:
            found.add(name)
            chosen.add(t.name)
            if t.name + SCALE_SUFFIX in names:
                chosen.add(t.name + SCALE_SUFFIX)
    missing = sorted(targets - found)
    odd = sorted(n for n in chosen if len(names[n].shape) < 2 or names[n].shape[1] % 2)
    if missing or odd:
        raise kernel_layout.ExpertLayoutError(
            f"{model_dir}: the {layout} expert layout needs fused [gate; up] experts in the arena; "
            + (
                f"not there: {', '.join(missing[:6])}"
                if missing
                else f"no halves to swap: {', '.join(odd[:6])}"
            )
        )
    return frozenset(chosen)


class WritableArena(Protocol):
    def tensor(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor: ...


def fill_arena(arena: WritableArena, shards: list[Shard], layout: ArenaLayout) -> str:
    """Copy every tensor into ``arena`` (converting dtype); return the sha256 content digest.

    The digest covers each shard's header and tensor bytes as stored, in file order. Each shard is
    read from a descriptor whose identity must equal the one its header was read with, before and
    after the copy: a file replaced or rewritten meanwhile fails the load instead of mixing bytes.
    """
    by_name = {e.name: e for e in layout.entries}
    staged = _Staging(arena, layout, by_name)
    digest = hashlib.sha256()
    for shard in shards:
        digest.update(shard.header)
        with open(shard.path, "rb", buffering=0) as f:
            _check_identity(shard, f.fileno())
            for rec in shard.tensors:
                raw = read_tensor_bytes(f, shard, rec)
                digest.update(raw)
                placement = layout.placements.get(rec.name)
                entry = by_name[placement.target if placement else rec.name]
                part = layout.shards.get(entry.name)  # a tensor-parallel rank's slice of it
                if entry.name in layout.quantized:
                    staged.write(entry, rec, raw, placement, part)
                else:
                    write_serving_tensor(arena, entry, rec, raw, placement, part)
                del raw
            _check_identity(shard, f.fileno())
    staged.check_done()
    for entry in layout.entries:
        if entry.name in layout.up_first and entry.name not in layout.quantized:  # quantized: swapped staged
            kernel_layout.swap_halves_(arena.tensor(entry.offset, entry.dtype, entry.shape))
    return digest.hexdigest()


class _Staging:
    """Tensors quantized online: each is gathered in its serving dtype (a merged stack from all its
    experts), then quantized into its e4m3 entry and its scale entry, and the staging freed."""

    def __init__(self, arena: WritableArena, layout: ArenaLayout, by_name: dict[str, TensorEntry]) -> None:
        self.arena, self.layout, self.by_name = arena, layout, by_name
        self.pending: dict[str, tuple[torch.Tensor, int]] = {}  # name -> (staging tensor, sources seen)

    def write(
        self,
        entry: TensorEntry,
        rec: TensorRecord,
        raw: bytearray | torch.Tensor,
        placement: serving_layout.Placement | None,
        shard: TensorShard | None = None,
    ) -> None:
        q = self.layout.quantized[entry.name]
        staging, seen = self.pending.get(entry.name) or (torch.empty(entry.shape, dtype=q.staging), 0)
        staging_entry = TensorEntry(entry.name, q.staging, entry.shape, 0, staging.nbytes)
        if not write_serving_tensor(_Whole(staging), staging_entry, rec, raw, placement, shard):
            return  # another rank's slice
        seen += 1
        if seen < q.sources:
            self.pending[entry.name] = (staging, seen)
            return
        self.pending.pop(entry.name, None)
        if entry.name in self.layout.up_first:  # the kernel layout's swap comes before quantization
            staging = kernel_layout.up_first(staging)
        if staging.numel():
            weight, scale = quantize_blocks(staging, q.block)
            self.arena.tensor(entry.offset, entry.dtype, entry.shape).copy_(weight)
            scale_entry = self.by_name[q.scale]
            self.arena.tensor(scale_entry.offset, scale_entry.dtype, scale_entry.shape).copy_(scale)

    def check_done(self) -> None:
        if self.pending:
            names = ", ".join(sorted(self.pending))
            raise CheckpointError(f"tensors never completed for quantization: {names}")


class _Whole:
    """A single tensor seen as an arena whose only entry starts at offset 0 (staging for quantization)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def tensor(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return self._tensor


def _check_identity(shard: Shard, fd: int) -> None:
    if FileIdentity.of(os.fstat(fd)) != shard.identity:
        raise CheckpointError(f"{shard.path}: changed on disk while it was being loaded")


def read_tensor_bytes(f: BinaryIO, shard: Shard, rec: TensorRecord) -> bytearray:
    """The stored bytes of one tensor (what the content digest covers)."""
    raw = bytearray(rec.nbytes)
    f.seek(rec.offset)
    got = f.readinto(raw)
    if got != rec.nbytes:
        raise CheckpointError(f"{shard.path}: short read for {rec.name} ({got} of {rec.nbytes} bytes)")
    return raw


def write_serving_tensor(
    arena: WritableArena,
    entry: TensorEntry,
    rec: TensorRecord,
    raw: bytearray | torch.Tensor,
    placement: serving_layout.Placement | None = None,
    shard: TensorShard | None = None,
) -> bool:
    """Convert one stored tensor into its serving layout in the arena: the serving dtype, for an
    expert merged into a fused 3-D tensor that expert's slice of it, and for a tensor-parallel rank
    (``shard``) only the part of it the rank holds. False when none of it is this rank's.

    Conversion steps slot in here; they must be named in the key's ``conversion`` field.
    """
    if rec.nbytes == 0:
        return True
    src = raw if isinstance(raw, torch.Tensor) else torch.frombuffer(raw, dtype=torch.uint8).view(rec.dtype)
    src = src.view(rec.shape)
    dest = arena.tensor(entry.offset, entry.dtype, entry.shape)
    if placement is not None:  # one expert's rows of a merged tensor [E, rows, cols]
        src = src.unsqueeze(0)
        starts: tuple[int, ...] = (placement.expert, placement.rows[0], 0)
    else:
        starts = (0,) * src.ndim
    if shard is None:
        region = tuple(slice(s, s + n) for s, n in zip(starts, src.shape, strict=True))
        dest[region].copy_(src)
        return True
    copies = shard.copies(starts, tuple(src.shape))
    for source, target in copies:
        if source is None:
            dest[target].zero_()
        else:
            dest[target].copy_(src[source])
    return bool(copies)


# The disk path's time goes to faulting in the fresh pages of each converted tensor, not to the
# conversion (2 GiB bf16 -> fp32 on a 2-core VM: 3.2-4.9 s in one thread, 1.9 s in two): it writes
# tensors in parallel, one thread per usable core up to this many, once there is this much to read.
DISK_WORKERS_MAX = 8
DISK_PARALLEL_BYTES = 64 << 20


class PrivateArena:
    """An arena in this process's own memory, on ``device``: the disk path's. Its pages are backed
    when first written, so a region nothing is written to (a tensor served from the file mapping)
    costs address space only; on the CPU they are huge pages where the kernel allows them
    (weights/huge_pages.py ``huge_anonymous``), as a node cache's arenas are."""

    def __init__(self, size: int, device: torch.device) -> None:
        mapping = huge_anonymous(size) if device.type == "cpu" else None
        if mapping is not None:  # the tensor keeps the mapping
            self.buffer = torch.frombuffer(mapping, dtype=torch.uint8, count=max(size, 1))
        else:
            self.buffer = torch.empty(max(size, 1), dtype=torch.uint8, device=device)

    def tensor(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        nbytes = dtype.itemsize
        for dim in shape:
            nbytes *= dim
        return self.buffer[offset : offset + nbytes].view(dtype).view(shape)


def load_serving_layout(
    shards: list[Shard],
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    quantization: Fp8Settings | None = None,
    expert_layout: str = kernel_layout.MODEL,
    sharding: Sharding = WHOLE,
) -> dict[str, torch.Tensor]:
    """The disk path of a model: the daemon's own plan (``plan_layout``: serving dtype, expert merges,
    online FP8, the kernel's expert layout, a tensor-parallel rank's slices) filled into a
    PrivateArena, so a client gets from disk the very tensors, names and bits a cache hit gives, and
    never asks where they came from.

    Each shard is mapped once (copy-on-write: nothing written to a tensor reaches the file) and each
    tensor written straight from the mapping, in parallel threads (torch's copies release the GIL);
    tensors quantized online are staged and quantized as the daemon does, after. A tensor the plan
    leaves as stored (same dtype, not merged, quantized or swapped) on the CPU is served from the
    mapping itself, its pages read when first touched, as a plain safetensors load leaves it, where
    it starts on a cache line (CACHE_LINE); one that does not is written into the arena like the rest.
    A shard whose identity changed since its header was read is refused by name (CheckpointError)."""
    device = torch.device(device)
    layout = plan_layout(shards, dtype, quantization, expert_layout, sharding)
    arena = PrivateArena(layout.size, device)
    by_name = {e.name: e for e in layout.entries}
    views: dict[str, torch.Tensor] = {}
    writes: list[_Write] = []
    staged: list[_Write] = []
    for shard, stored in _mapped(shards):
        for rec in shard.tensors:
            placement = layout.placements.get(rec.name)
            entry = by_name[placement.target if placement else rec.name]
            src = _stored_view(stored, rec)
            part = layout.shards.get(entry.name)
            if entry.name in layout.quantized:
                staged.append((entry, rec, src, placement, part))
            elif (
                device.type == "cpu"
                and placement is None
                and entry.dtype == rec.dtype
                and entry.name not in layout.up_first
                and (view := _held_view(src, part)) is not None
                and view.data_ptr() % CACHE_LINE == 0
            ):
                views[entry.name] = view
            else:
                writes.append((entry, rec, src, placement, part))
    _parallel(lambda w: write_serving_tensor(arena, *w), writes, sum(w[1].nbytes for w in writes))
    staging = _Staging(arena, layout, by_name)
    for entry, rec, src, placement, part in staged:
        staging.write(entry, rec, src, placement, part)
    staging.check_done()
    for entry in layout.entries:
        if entry.name in layout.up_first and entry.name not in layout.quantized:  # quantized: swapped staged
            kernel_layout.swap_halves_(arena.tensor(entry.offset, entry.dtype, entry.shape))
    _check_unchanged(shards)
    return {
        e.name: views[e.name] if e.name in views else arena.tensor(e.offset, e.dtype, e.shape)
        for e in layout.entries
    }


_Write = tuple[TensorEntry, TensorRecord, torch.Tensor, serving_layout.Placement | None, TensorShard | None]


def _held_view(src: torch.Tensor, shard: TensorShard | None) -> torch.Tensor | None:
    """What this rank holds of a stored tensor as a view of the file mapping, when it is one
    contiguous run (the whole tensor, or a run of its rows); else None (it is written instead)."""
    if shard is None or shard.whole_here:
        return src
    rows = shard.rows()
    return src[rows[0] : rows[1]] if rows is not None else None


def load_from_disk(shards: list[Shard], dtype: torch.dtype, device: str | torch.device = "cpu"):
    """Every tensor as stored, floats converted to ``dtype`` (a LoRA adapter's disk path, whose arena
    is plain_layout): mapped and converted as ``load_serving_layout`` does."""
    device = torch.device(device)
    jobs = [(rec, _stored_view(stored, rec)) for shard, stored in _mapped(shards) for rec in shard.tensors]

    def convert(job: tuple[TensorRecord, torch.Tensor]) -> tuple[str, torch.Tensor]:
        rec, src = job
        return rec.name, src.to(device=device, dtype=tensor_serving_dtype(rec.name, rec.dtype, dtype))

    tensors = dict(_parallel(convert, jobs, sum(rec.nbytes for rec, _ in jobs)))
    _check_unchanged(shards)
    return tensors


def _mapped(shards: list[Shard]) -> list[tuple[Shard, torch.Tensor | None]]:
    """Each shard with its bytes mapped copy-on-write (None for an empty file), checked unchanged."""
    import mmap

    out = []
    for shard in shards:
        with open(shard.path, "rb") as f:
            _check_identity(shard, f.fileno())
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if shard.size else None
        out.append((shard, torch.frombuffer(mapping, dtype=torch.uint8) if mapping is not None else None))
    return out


def _check_unchanged(shards: list[Shard]) -> None:
    for shard in shards:
        with open(shard.path, "rb") as f:
            _check_identity(shard, f.fileno())


def _parallel(fn: Callable[[T], R], jobs: list[T], nbytes: int) -> list[R]:
    """``fn`` over ``jobs`` in order, in threads when ``nbytes`` are enough to read (DISK_PARALLEL_BYTES)."""
    from concurrent.futures import ThreadPoolExecutor

    workers = min(DISK_WORKERS_MAX, len(os.sched_getaffinity(0))) if nbytes >= DISK_PARALLEL_BYTES else 1
    if workers == 1:
        return [fn(job) for job in jobs]
    with ThreadPoolExecutor(workers, thread_name_prefix="keepwarm-disk") as pool:
        return list(pool.map(fn, jobs))


def _stored_view(stored: torch.Tensor | None, rec: TensorRecord) -> torch.Tensor:
    """The tensor's bytes in the shard's mapping, as its stored dtype and shape (a copy only when its
    offset does not suit the dtype, which safetensors' own alignment makes rare)."""
    if rec.nbytes == 0 or stored is None:
        return torch.empty(rec.shape, dtype=rec.dtype)
    raw = stored[rec.offset : rec.offset + rec.nbytes]
    if rec.offset % rec.dtype.itemsize:
        raw = raw.clone()
    return raw.view(rec.dtype).view(rec.shape)
