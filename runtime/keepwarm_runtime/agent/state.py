"""Pure parts of the node agent: which models its WeightCacheNode wants here, and the status to report.

The node's wanted models arrive as the typed WeightCacheNode spec of keepwarm_api (the operator writes
it). Each model's LoRA adapters are wanted entries of their own (kind adapter, keyed
``<model>/<adapter>``: adapter_key), loaded, retried and released by the same bookkeeping as models, and
reported apart, under status.adapters. A model held as tensor-parallel shards (its parallelism) is one
book entry per shard a daemon holds (``<model>#<rank>``: shard_entries), reported as the model's entry
with the ranks held (``shards``; per GPU under status.gpus). Model and adapter directories follow
keepwarm_api.paths, the convention the operator mounts sources by; the status is built by
keepwarm_api.weightcachenode.agent_status from the daemons' snapshots (cache/snapshot.py, read by
attribute; one per GPU with per-GPU daemons, each tracked in its own DaemonBook), and written only when
it differs from the stored one (status_differs) other than in its heartbeat stamp: liveness is the
node's Lease (keepwarm_api.lease), so a steady node writes no WeightCacheNode at all.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from keepwarm_api.common import ConditionStatus, ModelSource, Parallelism, Quantization, SecretKeyRef
from keepwarm_api.lease import parse_time
from keepwarm_api.paths import (
    CACHED_ADAPTERS_ROOT,
    HOST_MODELS_MOUNT,
    MODELS_ROOT,
    cached_adapter_dir,
    host_model_dir,
    model_dir,
)
from keepwarm_api.refusals import Refusals
from keepwarm_api.weightcachenode import (
    STALE,
    GPUModel,
    GPUResidency,
    ModelState,
    ResidentAdapter,
    ResidentModel,
    WeightCacheNodeSpec,
    WeightCacheNodeStatus,
    agent_status,
    combine_gpus,
)
from keepwarm_runtime.cache.adapters import KIND_ADAPTER, KIND_MODEL
from keepwarm_runtime.cache.gpus import held_ranks
from keepwarm_runtime.cache.snapshot import DaemonSnapshot
from keepwarm_runtime.weights.tensor_parallel import Sharding

EVICTED_MESSAGE = "evicted under the budget"
RETRY_BASE_S = 10.0  # first retry of a failed or evicted model after this long, then doubling
RETRY_CAP_S = 600.0  # ... up to this


def adapter_key(model: str, adapter: str) -> str:
    """The agent's name for an adapter in its books: "<model>/<adapter>" (never a model's name: those
    are DNS labels, without a slash)."""
    return f"{model}/{adapter}"


@dataclass(frozen=True)
class WantedModel:
    name: str  # model name in the WeightCache; for an adapter its adapter_key
    path: str | None  # directory to load (None for a Hub source still to download)
    pin: bool
    repo: str | None = None  # Hugging Face source
    revision: str | None = None
    quantization: Quantization = Quantization.NONE  # applied by the daemon at load
    token: SecretKeyRef | None = None  # Hub token, read by the agent from a Secret in its namespace
    model: str | None = None  # set for an adapter: the model it adapts
    adapter: str | None = None  # set for an adapter: its name within that model
    parallelism: Parallelism = field(default_factory=Parallelism)  # held as tensor-parallel shards

    @property
    def kind(self) -> str:
        """What the daemon loads: a model or a LoRA adapter (CacheDaemon.add_model's kind)."""
        return KIND_MODEL if self.adapter is None else KIND_ADAPTER


@dataclass
class DaemonBook:
    """One daemon's share of the agent's bookkeeping: one per GPU (gpu tier), or the host tier's one."""

    daemon_names: dict[str, str] = field(default_factory=dict)  # WeightCache name -> daemon name
    loading: set[str] = field(default_factory=set)
    failed: dict[str, str] = field(default_factory=dict)  # name -> message
    evicted: set[str] = field(default_factory=set)
    attempts: dict[str, int] = field(default_factory=dict)  # name -> failed loads/evictions in a row
    retry_at: dict[str, dt.datetime] = field(default_factory=dict)  # name -> next try (failed/evicted)


@dataclass
class AgentState:
    """What the agent knows between ticks (owned by the agent thread, read by the reporter)."""

    books: dict[str, DaemonBook] = field(default_factory=dict)  # GPU UUID ("" for host.sock) -> book
    generation: int | None = None  # WeightCacheNode generation last acted on
    message: str = ""
    reporting_since: dt.datetime = field(default_factory=lambda: now())  # Stale=False since then


@dataclass(frozen=True)
class Entry:
    """What one daemon holds of a wanted model: the model, or one of its tensor-parallel shards."""

    name: str  # the agent's book key: the WeightCache name, a shard's with "#<rank>" (shard_entries)
    wanted: WantedModel
    rank: int | None = None  # the shard's rank; None: the whole model (or an adapter)


def shard_entries(w: WantedModel, daemon_index: int, daemons: int) -> list[Entry]:
    """The entries the ``daemon_index``-th of a node's ``daemons`` holds of ``w``: the model, or the
    shards cache.gpus.held_ranks gives it (every rank in one daemon; rank i mod N on the i-th GPU).
    A shard's book key adds "#<rank>" to the name (a DNS label: never one of its own)."""
    if w.parallelism.tensor == 1 or w.adapter is not None:
        return [Entry(w.name, w)]
    ranks = held_ranks(daemon_index, daemons, w.parallelism.tensor)
    return [Entry(f"{w.name}#{rank}", w, rank) for rank in ranks]


def load_options(w: WantedModel, rank: int | None = None) -> dict[str, Any]:
    """Keywords of `CacheDaemon.add_model` for a wanted model: its pin and the quantization the
    daemon applies at load (`quantization: fp8` -> online FP8 in the arena, part of the cache key);
    for an adapter its pin and kind (adapters are held as stored: no quantization)."""
    if w.adapter is not None:
        return {"pin": w.pin, "kind": KIND_ADAPTER}
    online = None if w.quantization == Quantization.NONE else w.quantization.value
    options: dict[str, Any] = {"pin": w.pin, "quantization": online}
    if rank is not None:  # a shard (shard_entries)
        parallel = w.parallelism
        options["sharding"] = Sharding(rank, parallel.tensor, parallel.expert)
    return options


def wanted_models(
    spec: WeightCacheNodeSpec,
    host_root: str = HOST_MODELS_MOUNT,
    pvc_root: str = MODELS_ROOT,
    adapter_root: str = CACHED_ADAPTERS_ROOT,
) -> list[WantedModel]:
    """The node's models, then their adapters, each with the directory it is read from in the agent
    pod (Hub: downloaded). Adapters share their model's pin."""
    models, adapters = [], []
    for m in spec.models:
        pvc_dir = model_dir(m.name, pvc_root)
        wanted = _wanted(
            m.name, m.source, spec.model_directory, host_root, pvc_dir, pin=m.pin, quantization=m.quantization
        )
        models.append(dataclasses.replace(wanted, parallelism=m.parallelism))
        for a in m.adapters:
            pvc_dir = cached_adapter_dir(m.name, a.name, adapter_root)
            wanted = _wanted(
                adapter_key(m.name, a.name), a.source, spec.model_directory, host_root, pvc_dir, pin=m.pin
            )
            adapters.append(dataclasses.replace(wanted, model=m.name, adapter=a.name))
    return models + adapters


def _wanted(
    name: str,
    source: ModelSource,
    model_directory: str,
    host_root: str,
    pvc_dir: str,
    pin: bool,
    quantization: Quantization = Quantization.NONE,
) -> WantedModel:
    hf, path = source.hugging_face, source.path
    if hf is not None:
        return WantedModel(name, None, pin, hf.repo, hf.revision, quantization, hf.token_secret_ref)
    if path is not None:  # under modelDirectory, which the DaemonSet mounts once
        return WantedModel(
            name, host_model_dir(path, model_directory, host_root), pin, quantization=quantization
        )
    return WantedModel(name, pvc_dir, pin, quantization=quantization)  # pvc: mounted one by one


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(microsecond=0)


def retry_delay(attempts: int, base_s: float = RETRY_BASE_S, cap_s: float = RETRY_CAP_S) -> float:
    """Exponential backoff after `attempts` failures in a row (1 -> base), capped."""
    return min(cap_s, base_s * 2 ** max(0, attempts - 1))


def _retry_note(state: DaemonBook, name: str) -> str:
    at = state.retry_at.get(name)
    if at is None:
        return ""
    stamp = at.isoformat().replace("+00:00", "Z")
    return f" (attempt {state.attempts.get(name, 1)}; retrying at {stamp})"


def resident_model(
    w: WantedModel, state: DaemonBook, snapshot: DaemonSnapshot, entries: list[Entry] | None = None
) -> ResidentModel:
    """One model's entry for one daemon, from its snapshot and the agent's bookkeeping of it; a model
    held as shards (``entries``: shard_entries) combines its shards' entries as combine_gpus combines
    GPUs: Resident when every shard is, with the ranks held under shards."""
    if entries is not None and any(e.rank is not None for e in entries):
        per_shard = {f"rank {e.rank}": _entry(w, e.name, state, snapshot, e.rank) for e in entries}
        combined = combine_gpus(per_shard)
        return combined.model_copy(
            update={"gpu_uuids": sorted({u for m in per_shard.values() for u in m.gpu_uuids})}
        )
    return _entry(w, w.name, state, snapshot, None)


def _entry(
    w: WantedModel, key: str, state: DaemonBook, snapshot: DaemonSnapshot, rank: int | None
) -> ResidentModel:
    """One book entry (the model, or a shard of it) as a status entry named after the model."""
    base = ResidentModel(name=w.name, state=ModelState.LOADING, pinned=w.pin, tier=snapshot.tier)
    info = snapshot.models.get(state.daemon_names.get(key, ""))
    if info is not None:
        return base.model_copy(
            update={
                "state": ModelState.RESIDENT,
                "bytes": info.nbytes,
                "fingerprint": info.key_digest,
                "digest": info.digest,
                "pinned": info.pinned,
                "gpu_uuids": list(info.gpu_uuids),
                "shards": [] if rank is None else [rank],
            }
        )
    note = _retry_note(state, key)
    retry = {"attempts": state.attempts.get(key, 0), "retry_at": state.retry_at.get(key)}
    if key in state.failed and key not in state.loading:
        message = state.failed[key][: 1000 - len(note)] + note
        return base.model_copy(update={"state": ModelState.FAILED, "message": message, **retry})
    if key in state.evicted and key not in state.loading:
        return base.model_copy(
            update={"state": ModelState.EVICTED, "message": EVICTED_MESSAGE + note, **retry}
        )
    return base


def resident_adapter(w: WantedModel, m: ResidentModel) -> ResidentAdapter:
    """An adapter's status entry from the entry resident_model (or combine_gpus) made for it."""
    assert w.model is not None and w.adapter is not None  # an adapter (wanted_models)
    return ResidentAdapter(
        model=w.model,
        name=w.adapter,
        state=m.state,
        bytes=m.bytes,
        fingerprint=m.fingerprint,
        gpu_uuids=m.gpu_uuids,
        message=m.message,
        attempts=m.attempts,
        retry_at=m.retry_at,
    )


def split_adapters(
    wanted: list[WantedModel], entries: list[ResidentModel]
) -> tuple[list[ResidentModel], list[ResidentAdapter]]:
    """Entries made for `wanted` (same order) as the models' and the adapters' status entries."""
    models = [m for w, m in zip(wanted, entries, strict=True) if w.adapter is None]
    adapters = [resident_adapter(w, m) for w, m in zip(wanted, entries, strict=True) if w.adapter is not None]
    return models, adapters


def gpu_model(m: ResidentModel) -> GPUModel:
    """A model's entry on one GPU (the per-GPU part of its status entry)."""
    return GPUModel(name=m.name, state=m.state, bytes=m.bytes, shards=m.shards, message=m.message)


def latest_refusals(snapshots: dict[str, DaemonSnapshot]) -> Refusals | None:
    """The most recent episode of refused clients across the node's daemons (one per GPU or one)."""
    episodes = [r for snap in snapshots.values() if (r := snap.refusals) is not None]
    return max(episodes, key=lambda r: r.last_at, default=None)


def node_status(
    state: AgentState, snapshots: dict[str, DaemonSnapshot], wanted: list[WantedModel], version: str
) -> WeightCacheNodeStatus:
    """The WeightCacheNode status this agent reports now (the one place agent status is built).

    ``snapshots`` maps each daemon's GPU UUID ("" for the host tier's one daemon) to its snapshot.
    With per-GPU daemons each GPU is reported under gpus and each model's node-level entry combines
    them (Resident only when every GPU holds it: weightcachenode.combine_gpus); adapters combine the
    same way and are reported under adapters only (status.gpus lists models).
    """
    order = sorted(snapshots)  # the daemons as the agent numbers them (KubernetesAgent.daemon_index)
    per_daemon = {
        key: [
            resident_model(
                w, state.books.get(key) or DaemonBook(), snap, shard_entries(w, order.index(key), len(order))
            )
            for w in wanted
        ]
        for key, snap in snapshots.items()
    }
    gpu_keys = sorted(k for k in per_daemon if k)
    refusals = latest_refusals(snapshots)
    if not gpu_keys:
        models, adapters = split_adapters(wanted, next(iter(per_daemon.values()), []))
        gpus = [u for snap in snapshots.values() if (u := snap.gpu_uuid)]
        return agent_status(
            models,
            gpus,
            version,
            state.message,
            now(),
            state.reporting_since,
            refusals=refusals,
            adapters=adapters,
        )
    per_gpu = [
        GPUResidency(
            uuid=key,
            models=[gpu_model(m) for w, m in zip(wanted, per_daemon[key], strict=True) if w.adapter is None],
        )
        for key in gpu_keys
    ]
    combined = [combine_gpus({key: per_daemon[key][i] for key in gpu_keys}) for i in range(len(wanted))]
    models, adapters = split_adapters(wanted, combined)
    return agent_status(
        models,
        gpu_keys,
        version,
        state.message,
        now(),
        state.reporting_since,
        gpus=per_gpu,
        refusals=refusals,
        adapters=adapters,
    )


def fresh_since(stored: dict[str, Any] | None, since: dt.datetime, now: dt.datetime) -> dt.datetime:
    """lastTransitionTime of the Stale=False condition the agent reports: kept from the stored status
    while that says False, `now` once it says otherwise (the operator marked the node Stale: reporting
    again is a transition), `since` (the agent's start) when nothing was stored yet."""
    for cond in (stored or {}).get("conditions") or []:
        if cond.get("type") == STALE:
            if cond.get("status") == ConditionStatus.FALSE.value and cond.get("lastTransitionTime"):
                return parse_time(cond["lastTransitionTime"])
            return now
    return since


def status_differs(stored: dict[str, Any] | None, status: WeightCacheNodeStatus) -> bool:
    """Whether writing `status` changes the stored one other than in its heartbeat stamp (both sides
    read through the model, so defaults and field order do not count)."""
    if stored is None:
        return True
    try:
        old = WeightCacheNodeStatus.model_validate(stored).wire()
    except ValidationError:  # written by another version in another shape: ours replaces it
        return True
    new = status.wire()
    old.pop("heartbeat", None)
    new.pop("heartbeat", None)
    return old != new
