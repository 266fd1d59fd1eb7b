"""WeightCacheNode (cluster-scoped, named <cache>.<node>, owned by its WeightCache).

The operator creates one per node an agent runs on and writes into its spec the models that node should
hold (node_spec; KServe's LocalModelNode way), each model with its LoRA adapters: the agent watches only
this object, so the agent DaemonSet's pod template never changes when models do. The agent on that node
writes its status (agent_status): models under status.models (what the warm rule reads), adapters under
status.adapters, by model and name. The operator only marks it Stale when the heartbeat stops and
deletes it when the Node is gone or no longer selected.

Per-GPU truth: on the gpu tier the agent runs one daemon per GPU (each on gpu-<UUID>.sock, the socket
an inference pod on that GPU attaches to) and reports each GPU's models under status.gpus. The warm
rule (resident_models) is: a node holds a model when EVERY GPU it reports holds it. The device plugin,
not keepwarm, picks which of the node's GPUs a pod gets, so "at least N of them" (N = the pod's GPU
request) would still send some pods to a cold GPU; only "all" makes the node-level warm label true for
any pod placed there. The host tier has one daemon (host.sock) that serves every GPU: no status.gpus.
"""

from __future__ import annotations

import datetime as dt
from enum import StrEnum
from typing import Any

from pydantic import Field

from .common import Condition, ConditionStatus, KubeModel, upsert_conditions
from .refusals import Refusals
from .weightcache import DEFAULT_HEARTBEAT_S, DEFAULT_MODEL_DIRECTORY, CachedModel, WeightCacheSpec

KIND = "WeightCacheNode"
PLURAL = "weightcachenodes"
SHORT_NAMES = ["wcn"]
STALE_HEARTBEATS = 4  # missed heartbeats before a node is Stale
STALE = "Stale"  # condition type: True (set by the operator) when the heartbeat stopped
HEARTBEAT_FRESH, HEARTBEAT_MISSED = "HeartbeatFresh", "HeartbeatMissed"  # its reasons
PEERS_REFUSED = "PeersRefused"  # condition type: True while the node's daemon refuses clients (agent)
PEER_NOT_ALLOWED = "PeerNotAllowed"  # its reason
DAEMON_STARTED = "DaemonStarted"  # condition type: False (agent) when the node's daemon could not start
START_FAILED = "StartFailed"  # its reason


def object_name(cache: str, node: str) -> str:
    return f"{cache}.{node}"


IMMUTABLE = {
    "x-kubernetes-validations": [{"rule": "self == oldSelf", "message": "immutable; delete and recreate"}]
}


class WeightCacheNodeSpec(KubeModel):
    """Which cache and node this object reports on (immutable) and what the node's agent should hold
    (written by the operator whenever the WeightCache's models change)."""

    weight_cache: str = Field(min_length=1, max_length=63, json_schema_extra=IMMUTABLE)
    """Name of the owning WeightCache."""
    node_name: str = Field(min_length=1, max_length=253, json_schema_extra=IMMUTABLE)
    """Name of the Node."""
    models: list[CachedModel] = Field(
        default_factory=list,
        max_length=64,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    """Models the agent on this node keeps resident (sources, dtype, pins), as in the WeightCache."""
    model_directory: str = Field(default=DEFAULT_MODEL_DIRECTORY, max_length=4096)
    """The WeightCache's modelDirectory: path sources lie under it, mounted once in the agent."""
    heartbeat_seconds: int = Field(default=DEFAULT_HEARTBEAT_S, ge=1, le=3600)
    """How often the agent reports (the WeightCache's heartbeatSeconds)."""


class NodePhase(StrEnum):
    PENDING = "Pending"  # created; the agent has not reported yet
    LOADING = "Loading"  # agent reported; some models still loading
    READY = "Ready"  # every model resident
    DEGRADED = "Degraded"  # some model failed (see its message)
    STALE = "Stale"  # no heartbeat for STALE_HEARTBEATS periods (set by the operator)


class ModelState(StrEnum):
    LOADING = "Loading"
    RESIDENT = "Resident"
    EVICTED = "Evicted"
    FAILED = "Failed"


class ResidentModel(KubeModel):
    """One model as the agent holds it."""

    name: str
    """Model name (as in the WeightCache)."""
    state: ModelState
    """Loading, Resident, Evicted or Failed."""
    bytes: int = 0
    """Bytes held in the arenas (every GPU's copy counted)."""
    fingerprint: str = ""
    """WeightCacheKey hash (headers, sizes, arch, dtype, quantization, revision, TP, version)."""
    digest: str = ""
    """Content digest recorded while reading the files."""
    pinned: bool = False
    """Never evicted under budget pressure."""
    tier: str = ""
    """gpu or host."""
    gpu_uuids: list[str] = Field(default_factory=list)
    """GPUs holding a copy (gpu tier); Resident means all of status.gpus."""
    shards: list[int] = Field(default_factory=list)
    """A model held as tensor-parallel shards (spec.models[].parallelism): the ranks held here, each
    an arena of its own (every rank on the host tier; per GPU under status.gpus)."""
    message: str = ""
    """Why it failed (or on which GPUs it is still missing), when not Resident."""
    attempts: int = 0
    """Failed loads (or evictions) in a row, when state is Failed or Evicted."""
    retry_at: dt.datetime | None = None
    """When a Failed or Evicted model is tried again (exponential backoff, capped)."""


class ResidentAdapter(KubeModel):
    """One LoRA adapter of a model as the agent holds it (its state combined over the GPUs, as a
    model's is: Resident only when every GPU holds it)."""

    model: str
    """The model it adapts (as in the WeightCache)."""
    name: str
    """Adapter name, unique within its model."""
    state: ModelState
    """Loading, Resident, Evicted or Failed."""
    bytes: int = 0
    """Bytes held in the arenas (every GPU's copy counted)."""
    fingerprint: str = ""
    """Its cache key hash (file identity, tensor headers, dtype, keepwarm version)."""
    gpu_uuids: list[str] = Field(default_factory=list)
    """GPUs holding a copy (gpu tier)."""
    message: str = ""
    """Why it failed (or on which GPUs it is still missing), when not Resident."""
    attempts: int = 0
    """Failed loads (or evictions) in a row, when state is Failed or Evicted."""
    retry_at: dt.datetime | None = None
    """When a Failed or Evicted adapter is tried again (exponential backoff, capped)."""


class GPUModel(KubeModel):
    """One model as one GPU's daemon holds it."""

    name: str
    """Model name (as in the WeightCache)."""
    state: ModelState
    """Loading, Resident, Evicted or Failed on this GPU."""
    bytes: int = 0
    """Bytes held on this GPU."""
    shards: list[int] = Field(default_factory=list)
    """The tensor-parallel ranks this GPU's daemon holds of a model held as shards (rank i mod N on
    the i-th GPU)."""
    message: str = ""
    """Why it failed or was evicted on this GPU."""


class GPUResidency(KubeModel):
    """One GPU the agent sees and what its daemon (on gpu-<uuid>.sock) holds."""

    uuid: str = Field(max_length=128)
    """GPU UUID as nvidia-smi prints it (GPU-xxxxxxxx-...); pods on this GPU attach gpu-<uuid>.sock."""
    models: list[GPUModel] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    """The node's models on this GPU."""


def resident_models(models: list[ResidentModel], gpus: list[GPUResidency]) -> set[str]:
    """The warm rule (see the module docstring): with per-GPU reports, the models every reported GPU
    holds; without (host tier, or an agent from before per-GPU status), the models reported Resident."""
    if not gpus:
        return {m.name for m in models if m.state == ModelState.RESIDENT}
    held = [{m.name for m in g.models if m.state == ModelState.RESIDENT} for g in gpus]
    return set.intersection(*held)


def combine_gpus(per_gpu: dict[str, ResidentModel]) -> ResidentModel:
    """One model's node-level entry from its entries on each GPU (uuid -> entry, at least one).

    Resident only when resident on every GPU (the warm rule); else Failed when it failed on some GPU,
    Evicted when evicted on some, Loading otherwise; the message names the GPUs it is missing on.
    gpu_uuids lists the GPUs holding a copy, bytes counts every copy.
    """
    entries = list(per_gpu.values())
    holding = sorted(u for u, m in per_gpu.items() if m.state == ModelState.RESIDENT)
    first = next((m for m in entries if m.state == ModelState.RESIDENT), entries[0])
    shards = sorted({r for m in entries if m.state == ModelState.RESIDENT for r in m.shards})
    base = first.model_copy(
        update={"gpu_uuids": holding, "bytes": sum(m.bytes for m in entries), "message": "", "shards": shards}
    )
    if len(holding) == len(entries):
        return base
    for state in (ModelState.FAILED, ModelState.EVICTED):
        bad = {u: m for u, m in per_gpu.items() if m.state == state}
        if bad:
            worst = next(iter(bad.values()))
            message = "; ".join(f"{u}: {m.message}" for u, m in sorted(bad.items()))
            return base.model_copy(
                update={
                    "state": state,
                    "message": message[:1000],
                    "attempts": worst.attempts,
                    "retry_at": worst.retry_at,
                }
            )
    missing = sorted(set(per_gpu) - set(holding))
    return base.model_copy(
        update={"state": ModelState.LOADING, "message": f"loading on {', '.join(missing)}"[:1000]}
    )


class NodeSnapshot(KubeModel):
    """One process snapshot in the node's store: a runtime pod's prepared parent, taken by the agent's
    snapshot service (keepwarm_runtime.snapshot, docs/snapshots.md)."""

    key: str = Field(max_length=64)
    """Its key's digest: the store's directory name (packages, interpreter, model, CPU, kernel, CRIU,
    user)."""
    bytes: int = 0
    """Size of its images."""
    created: dt.datetime
    """When the agent took it."""
    restores: int = 0
    """Restores runtime pods reported."""


MAX_SNAPSHOTS_REPORTED = 64  # the newest; a store holding more reports these


class WeightCacheNodeStatus(KubeModel):
    """Written by the node agent (phase Stale by the operator)."""

    phase: NodePhase = NodePhase.PENDING
    """Pending, Loading, Ready, Degraded or Stale."""
    heartbeat: dt.datetime | None = None
    """Last time the agent reported."""
    models: list[ResidentModel] = Field(default_factory=list)
    """Models on this node."""
    adapters: list[ResidentAdapter] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["model", "name"]},
    )
    """LoRA adapters on this node, per model (spec.models[].adapters)."""
    total_bytes: int = 0
    """Bytes held across models and adapters."""
    gpu_uuids: list[str] = Field(default_factory=list)
    """GPUs the agent sees."""
    gpus: list[GPUResidency] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["uuid"]},
    )
    """Per GPU (gpu tier): which models its daemon holds, loads or failed; empty on the host tier."""
    agent_version: str = ""
    """keepwarm version of the agent."""
    message: str = ""
    """Detail for the phase."""
    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    """Stale (set by the operator); PeersRefused (set by the agent) while its daemon refuses clients;
    DaemonStarted=False (set by the agent) when its daemon could not start."""
    snapshots: list[NodeSnapshot] = Field(
        default_factory=list,
        max_length=MAX_SNAPSHOTS_REPORTED,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["key"]},
    )
    """Process snapshots in the node's store (with the WeightCache's snapshots enabled), newest first."""

    def resident(self) -> set[str]:
        """Models a pod placed on this node finds warm on whichever GPU it gets (resident_models)."""
        if self.phase == NodePhase.STALE:
            return set()
        return resident_models(self.models, self.gpus)

    def resident_adapters(self) -> set[tuple[str, str]]:
        """(model, adapter) pairs held here (each entry's state the agent combined over its GPUs)."""
        if self.phase == NodePhase.STALE:
            return set()
        return {(a.model, a.name) for a in self.adapters if a.state == ModelState.RESIDENT}


PRINTER_COLUMNS = [
    {"name": "Cache", "type": "string", "jsonPath": ".spec.weightCache"},
    {"name": "Node", "type": "string", "jsonPath": ".spec.nodeName"},
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Bytes", "type": "integer", "jsonPath": ".status.totalBytes"},
    {"name": "Heartbeat", "type": "date", "jsonPath": ".status.heartbeat"},
]


def node_spec(cache: str, node: str, spec: WeightCacheSpec) -> WeightCacheNodeSpec:
    """What the operator writes for the agent bound to `node`: the cache's models and their settings."""
    return WeightCacheNodeSpec(
        weight_cache=cache,
        node_name=node,
        models=list(spec.models),
        model_directory=spec.model_directory,
        heartbeat_seconds=spec.heartbeat_seconds,
    )


def phase_of(models: list[ResidentModel], adapters: list[ResidentAdapter] | None = None) -> NodePhase:
    """Degraded when a model or adapter failed, Ready when none is still loading, else Loading."""
    states = {m.state for m in [*models, *(adapters or [])]}
    if ModelState.FAILED in states:
        return NodePhase.DEGRADED
    if states <= {ModelState.RESIDENT, ModelState.EVICTED}:
        return NodePhase.READY
    return NodePhase.LOADING


def refusal_condition(refusals: Refusals, now: dt.datetime) -> Condition | None:
    """PeersRefused=True while the daemon's last refusal is recent (refusals.REFUSAL_WINDOW_S), else
    None: a pod whose uid or groups the daemon does not allow loads from disk, and this is where
    `kubectl describe wcn` says why."""
    if not refusals.recent(now):
        return None
    message = f"{refusals.reason} ({refusals.count} refused since {refusals.since:%Y-%m-%dT%H:%M:%SZ})"
    return Condition(
        type=PEERS_REFUSED,
        status=ConditionStatus.TRUE,
        reason=PEER_NOT_ALLOWED,
        message=message[:1000],
        last_transition_time=refusals.since,
    )


def start_failure_status(stored: dict[str, Any] | None, message: str, now: dt.datetime) -> dict[str, Any]:
    """The status an agent writes when its daemon cannot start (a socket directory of another owner,
    a tier the node lacks...) just before its process exits: Degraded, the reason in the message and
    in DaemonStarted=False, the other conditions kept. The next agent that reports replaces it all."""
    failed = Condition(
        type=DAEMON_STARTED, status=ConditionStatus.FALSE, reason=START_FAILED, message=message[:1000]
    )
    return {
        "phase": NodePhase.DEGRADED.value,
        "message": message[:1000],
        "conditions": upsert_conditions((stored or {}).get("conditions"), [failed], now),
    }


def agent_status(
    models: list[ResidentModel],
    gpu_uuids: list[str],
    version: str,
    message: str,
    now: dt.datetime,
    reporting_since: dt.datetime,
    gpus: list[GPUResidency] | None = None,
    refusals: Refusals | None = None,
    adapters: list[ResidentAdapter] | None = None,
) -> WeightCacheNodeStatus:
    """The status an agent reports: phase from its models and adapters (each combined over the GPUs
    when there are per-GPU reports), Stale=False since it started reporting, PeersRefused while the
    daemon refuses clients (refusal_condition)."""
    adapters = adapters or []
    fresh = Condition(
        type=STALE,
        status=ConditionStatus.FALSE,
        reason=HEARTBEAT_FRESH,
        last_transition_time=reporting_since,
    )
    refused = refusal_condition(refusals, now) if refusals else None
    return WeightCacheNodeStatus(
        phase=phase_of(models, adapters),
        heartbeat=now,
        models=models,
        adapters=adapters,
        total_bytes=sum(m.bytes for m in [*models, *adapters]),
        gpu_uuids=sorted(set(gpu_uuids) | {u for m in models for u in m.gpu_uuids}),
        gpus=gpus or [],
        agent_version=version,
        message=message,
        conditions=[fresh] if refused is None else [fresh, refused],
    )
