"""WeightCacheNode (cluster-scoped, named <cache>.<node>, owned by its WeightCache).

The operator creates one per node an agent runs on and writes into its spec the models that node
should hold (node_spec; KServe's LocalModelNode way): the agent watches only this object, so the agent
DaemonSet's pod template never changes when models do. The agent on that node writes its status
(agent_status). The operator only marks it Stale when the heartbeat stops and deletes it when the
Node is gone or no longer selected.
"""

from __future__ import annotations

import datetime as dt
from enum import StrEnum

from pydantic import Field

from .common import Condition, ConditionStatus, KubeModel
from .weightcache import DEFAULT_HEARTBEAT_S, DEFAULT_MODEL_DIRECTORY, CachedModel, WeightCacheSpec

KIND = "WeightCacheNode"
PLURAL = "weightcachenodes"
SHORT_NAMES = ["wcn"]
STALE_HEARTBEATS = 4  # missed heartbeats before a node is Stale
STALE = "Stale"  # condition type: True (set by the operator) when the heartbeat stopped
HEARTBEAT_FRESH, HEARTBEAT_MISSED = "HeartbeatFresh", "HeartbeatMissed"  # its reasons


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
    """Bytes held in the arena."""
    fingerprint: str = ""
    """WeightCacheKey hash (headers, sizes, arch, dtype, quantization, revision, TP, version)."""
    digest: str = ""
    """Content digest recorded while reading the files."""
    pinned: bool = False
    """Never evicted under budget pressure."""
    tier: str = ""
    """gpu or host."""
    gpu_uuids: list[str] = Field(default_factory=list)
    """GPUs holding a copy (gpu tier)."""
    message: str = ""
    """Why it failed, when state is Failed."""
    attempts: int = 0
    """Failed loads (or evictions) in a row, when state is Failed or Evicted."""
    retry_at: dt.datetime | None = None
    """When a Failed or Evicted model is tried again (exponential backoff, capped)."""


class WeightCacheNodeStatus(KubeModel):
    """Written by the node agent (phase Stale by the operator)."""

    phase: NodePhase = NodePhase.PENDING
    """Pending, Loading, Ready, Degraded or Stale."""
    heartbeat: dt.datetime | None = None
    """Last time the agent reported."""
    models: list[ResidentModel] = Field(default_factory=list)
    """Models on this node."""
    total_bytes: int = 0
    """Bytes held across models."""
    gpu_uuids: list[str] = Field(default_factory=list)
    """GPUs the agent sees."""
    agent_version: str = ""
    """keepwarm version of the agent."""
    message: str = ""
    """Detail for the phase."""
    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    """Stale (set by the operator)."""

    def resident(self) -> set[str]:
        if self.phase == NodePhase.STALE:
            return set()
        return {m.name for m in self.models if m.state == ModelState.RESIDENT}


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


def phase_of(models: list[ResidentModel]) -> NodePhase:
    """Degraded when a model failed, Ready when none is still loading, else Loading."""
    states = {m.state for m in models}
    if ModelState.FAILED in states:
        return NodePhase.DEGRADED
    if states <= {ModelState.RESIDENT, ModelState.EVICTED}:
        return NodePhase.READY
    return NodePhase.LOADING


def agent_status(
    models: list[ResidentModel],
    gpu_uuids: list[str],
    version: str,
    message: str,
    now: dt.datetime,
    reporting_since: dt.datetime,
) -> WeightCacheNodeStatus:
    """The status an agent reports: phase from its models, Stale=False since it started reporting."""
    fresh = Condition(
        type=STALE,
        status=ConditionStatus.FALSE,
        reason=HEARTBEAT_FRESH,
        last_transition_time=reporting_since,
    )
    return WeightCacheNodeStatus(
        phase=phase_of(models),
        heartbeat=now,
        models=models,
        total_bytes=sum(m.bytes for m in models),
        gpu_uuids=sorted(set(gpu_uuids) | {u for m in models for u in m.gpu_uuids}),
        agent_version=version,
        message=message,
        conditions=[fresh],
    )
