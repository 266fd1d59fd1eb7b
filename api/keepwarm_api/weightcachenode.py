"""WeightCacheNode (cluster-scoped, named <cache>.<node>, owned by its WeightCache).

The operator creates one per node an agent runs on (node_spec); the agent on that node writes its
status (agent_status). The operator only marks it Stale when the heartbeat stops and deletes it when
the Node is gone.
"""

from __future__ import annotations

import datetime as dt
from enum import StrEnum

from pydantic import Field

from .common import Condition, ConditionStatus, KubeModel

KIND = "WeightCacheNode"
PLURAL = "weightcachenodes"
SHORT_NAMES = ["wcn"]
STALE_HEARTBEATS = 4  # missed heartbeats before a node is Stale
STALE = "Stale"  # condition type: True (set by the operator) when the heartbeat stopped
HEARTBEAT_FRESH, HEARTBEAT_MISSED = "HeartbeatFresh", "HeartbeatMissed"  # its reasons


def object_name(cache: str, node: str) -> str:
    return f"{cache}.{node}"


class WeightCacheNodeSpec(KubeModel):
    """Which cache and node this object reports on (set by the operator, immutable)."""

    model_config = KubeModel.model_config | {
        "json_schema_extra": {
            "x-kubernetes-validations": [
                {"rule": "self == oldSelf", "message": "spec is immutable; delete and recreate instead"}
            ]
        }
    }

    weight_cache: str = Field(min_length=1, max_length=63)
    """Name of the owning WeightCache."""
    node_name: str = Field(min_length=1, max_length=253)
    """Name of the Node."""


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


def node_spec(cache: str, node: str) -> WeightCacheNodeSpec:
    """What the operator writes when an agent pod is bound to `node`."""
    return WeightCacheNodeSpec(weight_cache=cache, node_name=node)


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
