"""Taking arenas handed over (by a predecessor daemon or the holder): verify each, serve what holds.

A record is only a claim; before an arena is served, this daemon checks what it can without reading
the weights:

* the descriptor: on the host tier a memfd of exactly the recorded size whose seals all hold (no
  write, grow or shrink: nobody can have changed it); on the gpu tier the record's size is taken as
  given (the VMM handle cannot be inspected without importing it; untested on GPU);
* the files: every shard's header is re-read (a LoRA adapter's as an adapter, cache/adapters.py) and
  its identity (device, inode, size, mtime, ctime) must equal the one recorded at load, the check
  every hit makes: the same file, unchanged, is the one whose header was validated at that load;
* this daemon's configuration: tier, GPU, serving dtype and expert layout, by recomputing the key
  with its own settings (every field but ``version`` must agree); from another keepwarm version the
  arena layout is also re-planned (the tensor table must be the one this version would write, so a
  version whose layout changed reloads instead of misreading bytes), while the same version, whose
  key agrees on every field, wrote the table with this very code: its rows need only be well-formed
  and inside the arena;
* the budget: pinned and most recently used arenas first, each must fit beside those already taken.

An arena that fails any check is closed and named with the reason in the log and in
``keepwarm_cache_dropped_arenas_total`` (its label: the check, metrics.DROP_REASONS); the model is
then loaded from disk like any other (``--model`` or the node agent). The content digest is carried
over as recorded: the bytes themselves are sealed, so they are the bytes that were digested.

Only re-planning another version's layout imports torch (weights.arena); a record of this version is
verified and served without it, so a daemon restarted after a crash answers before torch is imported.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from keepwarm_runtime.cache.adapters import (
    KIND_ADAPTER,
    KIND_MODEL,
    adapter_file,
    adapter_key,
    adapter_layout,
    is_adapter_key,
)
from keepwarm_runtime.cache.backends.host import AdoptedArena, ArenaSealError, verify_sealed
from keepwarm_runtime.cache.fingerprint import WeightCacheKey
from keepwarm_runtime.cache.handoff import ArenaRecord, HandoffRefused, Stream, shard_identities
from keepwarm_runtime.cache.metrics import DROP_REASONS
from keepwarm_runtime.cache.registry import BudgetExceeded, ResidentModel
from keepwarm_runtime.weights.files import ITEMSIZE, CheckpointError, ShardFile, read_shard_files
from keepwarm_runtime.weights.layouts import MODEL, conversion_id
from keepwarm_runtime.weights.quantization import Fp8Settings, online_settings

if TYPE_CHECKING:
    from keepwarm_runtime.cache.core import DaemonCore

log = logging.getLogger(__name__)


class Unfit(Exception):
    """This arena cannot be served by this daemon: ``reason`` names the check (metrics.DROP_REASONS,
    a metric label), the message says why (logged, then reloaded)."""

    def __init__(self, reason: str, detail: str) -> None:
        assert reason in DROP_REASONS, reason  # a bounded label set
        super().__init__(f"{reason.replace('_', ' ')}: {detail}")
        self.reason = reason


@dataclass
class Adoption:
    taken: list[str]  # model names now served from handed-over arenas
    dropped: dict[str, str]  # model name -> why it was not taken
    seconds: float


def _check_descriptor(daemon: DaemonCore, record: ArenaRecord, fd: int) -> None:
    if record.tier != daemon.tier:
        raise Unfit("tier", f"the arena is {record.tier}, this daemon serves {daemon.tier}")
    if record.gpu_uuid != daemon.gpu_uuid:
        raise Unfit("gpu", f"the arena lives on {record.gpu_uuid}, this daemon serves {daemon.gpu_uuid}")
    if record.size <= 0:
        raise Unfit("size", f"{record.size} bytes")
    if record.tier == "host":
        try:
            verify_sealed(record.name, fd, record.size)
        except ArenaSealError as exc:
            raise Unfit("seals", str(exc)) from None


def _kind(record: ArenaRecord) -> str:
    """A LoRA adapter's arena (its key says so: cache/adapters.py), or a model's."""
    try:
        return KIND_ADAPTER if is_adapter_key(WeightCacheKey.from_dict(record.key)) else KIND_MODEL
    except ValueError:
        return KIND_MODEL  # _check_key names the malformed key


def _check_files(record: ArenaRecord, model_dir: Path, kind: str) -> list[ShardFile]:
    try:
        shards = [adapter_file(model_dir)] if kind == KIND_ADAPTER else read_shard_files(model_dir)
    except CheckpointError as exc:
        raise Unfit("files", str(exc)) from None
    want = shard_identities(record, model_dir)
    now = {s.path: s.identity.as_tuple() for s in shards}
    changed = sorted(p.name for p in set(want) | set(now) if want.get(p) != now.get(p))
    if changed:
        raise Unfit("changed_on_disk", ", ".join(changed[:6]))
    return shards


def _check_key(
    daemon: DaemonCore,
    record: ArenaRecord,
    model_dir: Path,
    shards: list[ShardFile],
    online: Fp8Settings | None,
    kind: str,
) -> WeightCacheKey:
    """This daemon's key for the model (its version), if the recorded key agrees on everything else."""
    try:
        handed = WeightCacheKey.from_dict(record.key)
    except ValueError as exc:
        raise Unfit("key", str(exc)) from None
    if kind == KIND_ADAPTER:
        candidates: tuple[WeightCacheKey, ...] = (adapter_key(model_dir, daemon.dtype, shards),)
    else:
        # a tensor-parallel shard is verified as that shard
        candidates = daemon.model_keys(model_dir, shards, online, handed.sharding)
    best = min(candidates, key=lambda k: len([f for f in handed.diff(k) if f != "version"]))
    differ = [f for f in handed.diff(best) if f != "version"]
    if differ:
        detail = ", ".join(f"{f} {getattr(handed, f)} (this daemon: {getattr(best, f)})" for f in differ)
        raise Unfit("key", detail[:500])
    return best


def verify(daemon: DaemonCore, record: ArenaRecord, fd: int) -> ResidentModel:
    """The resident model this daemon can serve from ``fd`` (which it then owns); Unfit otherwise."""
    _check_descriptor(daemon, record, fd)
    model_dir = Path(record.path)
    kind = _kind(record)
    shards = _check_files(record, model_dir, kind)
    try:
        online = online_settings(model_dir, record.quantization) if kind == KIND_MODEL else None
        key = _check_key(daemon, record, model_dir, shards, online, kind)
        if record.key.get("version") == key.version:  # same code, same key: the table it writes
            tensors, extent = record.tensors, _extent(record.tensors)
        else:
            key, tensors, extent = _replanned(daemon, record, shards, online, key, kind)
    except Unfit:
        raise
    except Exception as exc:  # a quantization or layout this version refuses, a malformed row
        raise Unfit("layout", f"{type(exc).__name__}: {str(exc)[:300]}") from None
    if extent > record.size:
        raise Unfit("layout", f"{extent} bytes of tensors do not fit the {record.size}-byte arena")
    pinned = record.pinned or record.name in daemon.config.pins or model_dir.name in daemon.config.pins
    return ResidentModel(
        record.name,
        model_dir,
        key,
        tensors,
        AdoptedArena(record.name, fd, record.size, record.page_mode),
        daemon.tier,
        record.digest,
        pinned,
        float(record.load_seconds),
        shards,
        gpu_uuid=daemon.gpu_uuid,
        quantization=record.quantization,
        hits=record.hits,
        last_used=time.monotonic() - float(record.idle_s),
        kind=kind,
        sharding=key.sharding,
    )


def _replanned(
    daemon: DaemonCore,
    record: ArenaRecord,
    shards: list[ShardFile],
    online: Fp8Settings | None,
    key: WeightCacheKey,
    kind: str,
) -> tuple[WeightCacheKey, list[list[Any]], int]:
    """Another version's arena: its tensor table must be the one this version plans (torch)."""
    from keepwarm_runtime.weights.arena import TensorEntry, plan_layout
    from keepwarm_runtime.weights.checkpoint import parse_checkpoint, parse_dtype

    parsed, dtype = parse_checkpoint(shards), parse_dtype(daemon.dtype)
    entries = tuple(TensorEntry.from_wire(row) for row in record.tensors)
    if kind == KIND_ADAPTER:
        layout = adapter_layout(parsed, dtype)
    else:
        sharding = key.sharding
        layout = plan_layout(parsed, dtype, online, daemon.config.expert_layout, sharding)
        converted = conversion_id(daemon.config.expert_layout if layout.up_first else MODEL, sharding)
        key = replace(key, conversion=converted)
    if entries != layout.entries:
        raise Unfit("layout", "the tensor table is not the one this version writes")
    return key, [e.to_wire() for e in layout.entries], layout.size


def _extent(rows: list[Any]) -> int:
    """Bytes a tensor table of wire rows ``[name, dtype, shape, offset, nbytes]`` spans; a malformed
    row, an unknown dtype, a negative offset or a size that does not match the shape is refused, as
    the client refuses it (client.check_layout)."""
    end = 0
    for row in rows:
        if not (isinstance(row, list) and len(row) == 5 and isinstance(row[0], str)):
            raise Unfit("layout", f"tensor row {str(row)[:80]} is not [name, dtype, shape, offset, nbytes]")
        name, dtype, shape, offset, nbytes = row
        if not isinstance(dtype, str) or dtype not in ITEMSIZE:
            raise Unfit("layout", f"tensor {name[:200]!r} has an unknown dtype {str(dtype)[:40]!r}")
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise Unfit("layout", f"tensor {name[:200]!r} has a malformed shape")
        count = ITEMSIZE[dtype]
        for d in shape:
            count *= d
        if not (_is_count(offset) and _is_count(nbytes)) or nbytes != count:
            raise Unfit("layout", f"tensor {name[:200]!r} is malformed")
        end = max(end, offset + nbytes)
    return end


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _order(stream: Stream) -> list[int]:
    """Indices of the stream's records: pinned first, then most recently used (what the budget keeps)."""

    def rank(i: int) -> tuple[int, float]:
        raw = stream.items[i][0]
        ok = isinstance(raw, dict)
        pinned = ok and raw.get("pinned") is True
        idle = raw.get("idle_s") if ok and isinstance(raw.get("idle_s"), (int, float)) else float("inf")
        return (0 if pinned else 1, float(idle))

    return sorted(range(len(stream.items)), key=rank)


def adopt(daemon: DaemonCore, stream: Stream, source: str, who: str = "") -> Adoption:
    """Verify every record of ``stream`` and insert those that hold into the daemon's registry.

    Descriptors taken are owned by their arenas (set to -1 in the stream); the caller closes the rest
    with ``stream.close()``. ``source`` (metrics.PREDECESSOR or HOLDER) labels the metrics and each
    model's origin; ``who`` ("pid N") only adds to the log.
    """
    started = time.perf_counter()
    taken: list[str] = []
    dropped: dict[str, str] = {}
    where = f"{source} {who}".strip()
    for i in _order(stream):
        raw, fd = stream.items[i]
        name = str(raw.get("name"))[:200] if isinstance(raw, dict) else "?"
        try:
            try:
                record = ArenaRecord.from_wire(raw)
            except HandoffRefused as exc:
                raise Unfit("record", str(exc)) from None
            if daemon.registry.get(record.name) is not None:
                raise Unfit("resident", "a model of that name is resident already")
            model = verify(daemon, record, fd)
            try:
                daemon.registry.reserve(model.nbytes, evict=False)
            except BudgetExceeded as exc:
                raise Unfit("budget", str(exc)) from None
        except Unfit as exc:
            dropped[name] = str(exc)
            daemon.metrics.dropped_arenas.labels(source, exc.reason).inc()
            log.warning("not taking %s from the %s: %s", name, where, exc)
            continue
        stream.items[i] = (raw, -1)  # the arena owns the descriptor now
        model.origin = source
        daemon.registry.insert(model)
        daemon.metrics.resident_bytes.labels(model.name, model.tier).set(model.nbytes)
        daemon.metrics.adopted_arenas.labels(source).inc()
        taken.append(model.name)
    seconds = time.perf_counter() - started
    daemon.metrics.adopt_seconds.labels(source).set(seconds)
    log.info(
        "took %d arenas from the %s in %.3fs without reading weights%s",
        len(taken),
        where,
        seconds,
        f"; {len(dropped)} dropped (reloaded if wanted): {', '.join(sorted(dropped))}" if dropped else "",
    )
    return Adoption(taken, dropped, seconds)


def refuse(daemon: DaemonCore, stream: Stream, source: str) -> None:
    """Count every arena of a stream refused as a whole (a record format this daemon does not read)."""
    if stream.items:
        daemon.metrics.dropped_arenas.labels(source, "format").inc(len(stream.items))
