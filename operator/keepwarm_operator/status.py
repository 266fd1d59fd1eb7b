"""Pure status aggregation: observed children in, CR status out. No API calls."""

from __future__ import annotations

import datetime as dt
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from keepwarm_api import lws
from keepwarm_api.common import Condition, condition
from keepwarm_api.inferencedeployment import IDepConditionType, IDepReason, InferenceDeploymentStatus
from keepwarm_api.weightcache import (
    AdapterResidency,
    ModelResidency,
    WeightCacheConditionType,
    WeightCacheReason,
    WeightCacheSpec,
    WeightCacheStatus,
)
from keepwarm_api.weightcachenode import STALE_HEARTBEATS, ModelState, NodePhase, WeightCacheNodeStatus

from .builders.meta import GPU_RESOURCE, warm_label_key


def now() -> dt.datetime:
    """The time conditions and staleness are stamped with (UTC, whole seconds)."""
    return dt.datetime.now(dt.UTC).replace(microsecond=0)


def resident_models(wcn: Mapping[str, Any]) -> frozenset[str]:
    """The models a WeightCacheNode reports resident (its status, as the agent wrote it)."""
    return frozenset(WeightCacheNodeStatus.model_validate(wcn.get("status") or {}).resident())


def node_belongs(labels: dict[str, str] | None, selector: dict[str, str]) -> bool:
    """Whether a node (its labels; None when it is gone) is one the cache's agents run on."""
    return labels is not None and all(labels.get(k) == v for k, v in selector.items())


def status_changed(old: dict[str, Any] | None, new: dict[str, Any]) -> bool:
    """Whether merging `new` into the stored status changes it: status is written only on change."""
    old = old or {}
    return any(old.get(key) != value for key, value in new.items())


def last_heard(
    status: WeightCacheNodeStatus, lease_renewed: dt.datetime | None, created: dt.datetime
) -> dt.datetime:
    """When the node's agent was last heard from: its Lease's renewal, or a status it wrote (an agent
    of an older version heartbeats there), or the object's creation when it never reported."""
    return max(t for t in (lease_renewed, status.heartbeat, created) if t is not None)


def is_stale(last: dt.datetime, heartbeat_seconds: int, now: dt.datetime) -> bool:
    """Nothing heard (last_heard) for STALE_HEARTBEATS periods."""
    return (now - last).total_seconds() > STALE_HEARTBEATS * heartbeat_seconds


def node_gpus(node: dict[str, Any]) -> int | None:
    """GPUs the Node offers pods: allocatable nvidia.com/gpu (capacity if it has no allocatable);
    None when it has neither (no device plugin: nothing to compare with)."""
    status = node.get("status") or {}
    for field in ("allocatable", "capacity"):
        value = (status.get(field) or {}).get(GPU_RESOURCE)
        if value is not None:
            try:
                return int(str(value))
            except ValueError:
                return None
    return None


def gpu_mismatches(
    reports: Iterable[tuple[str, WeightCacheNodeStatus]], offered: Mapping[str, int | None]
) -> list[str]:
    """One line per node (name, agent's status) whose agent sees another number of GPUs than the
    Node offers pods: pods then land on GPUs no daemon caches for (or the agent sees GPUs the
    scheduler will not hand out), while the node is labelled warm. Nodes whose agent has not
    reported yet (Pending) or went Stale, and Nodes without the resource, are not judged."""
    out = []
    for node, status in sorted(reports, key=lambda r: r[0]):
        want = offered.get(node)
        if want is None or status.phase in (NodePhase.PENDING, NodePhase.STALE):
            continue
        seen = len(status.gpu_uuids)
        if seen != want:
            out.append(f"{node}: agent sees {seen} GPU(s), Node allocatable {GPU_RESOURCE} is {want}")
    return out


def gpus_match_condition(mismatches: list[str], generation: int) -> Condition:
    """GPUsMatch: True when no node's counts differ; else False naming the nodes (at most 5)."""
    R, C = WeightCacheReason, WeightCacheConditionType
    if not mismatches:
        message = "every reporting agent sees as many GPUs as its Node offers pods"
        return condition(C.GPUS_MATCH, True, R.GPU_COUNTS_MATCH, message, generation)
    more = f"; and {len(mismatches) - 5} more node(s)" if len(mismatches) > 5 else ""
    return condition(C.GPUS_MATCH, False, R.GPU_COUNT_MISMATCH, "; ".join(mismatches[:5]) + more, generation)


def weightcache_status(
    spec: WeightCacheSpec, generation: int, desired_nodes: int, nodes: list[WeightCacheNodeStatus],
    gpu_mismatch: list[str] | None = None,
) -> WeightCacheStatus:  # fmt: skip
    """Ready when every desired node reports every model and adapter resident; Degraded on stale
    nodes or failed loads; GPUsMatch (tier gpu: pass gpu_mismatch, see gpu_mismatches) after them."""
    wanted = {m.name for m in spec.models}
    wanted_adapters = {(m.name, a.name) for m in spec.models for a in m.adapters}
    held_adapters = [n.resident_adapters() for n in nodes]  # once per node: read per adapter below
    ready = sum(
        1
        for n, held in zip(nodes, held_adapters, strict=True)
        if n.phase != NodePhase.STALE and wanted <= n.resident() and wanted_adapters <= held
    )
    stale = sum(1 for n in nodes if n.phase == NodePhase.STALE)
    residency = []
    for model in spec.models:
        resident = sum(1 for n in nodes if model.name in n.resident())
        failed = sum(
            1 for n in nodes for m in n.models if m.name == model.name and m.state == ModelState.FAILED
        )
        residency.append(ModelResidency(name=model.name, resident_nodes=resident, failed_nodes=failed))
    resident_count = Counter(pair for held in held_adapters for pair in held)
    failed_count = Counter(
        (a.model, a.name) for n in nodes for a in n.adapters if a.state == ModelState.FAILED
    )
    adapters = [
        AdapterResidency(
            model=model,
            name=name,
            resident_nodes=resident_count[model, name],
            failed_nodes=failed_count[model, name],
        )
        for model, name in sorted(wanted_adapters)
    ]
    failed_models = sorted(r.name for r in residency if r.failed_nodes)
    failed_models += [f"{a.model}/{a.name}" for a in adapters if a.failed_nodes]
    holding = "every model and adapter" if wanted_adapters else "every model"
    R, C = WeightCacheReason, WeightCacheConditionType
    if desired_nodes == 0:
        ready_cond = condition(
            C.READY, False, R.NO_NODES, "no node matches spec.nodeSelector/tolerations", generation
        )
    elif ready >= desired_nodes:
        ready_cond = condition(
            C.READY, True, R.ALL_NODES_READY, f"{ready}/{desired_nodes} nodes hold {holding}", generation
        )
    else:
        ready_cond = condition(
            C.READY, False, R.NODES_NOT_READY, f"{ready}/{desired_nodes} nodes hold {holding}", generation
        )
    if stale:
        degraded = condition(
            C.DEGRADED, True, R.NODES_STALE, f"{stale} node agent(s) stopped reporting", generation
        )
    elif failed_models:
        degraded = condition(
            C.DEGRADED, True, R.MODELS_FAILED,
            f"loading failed on some nodes for: {', '.join(failed_models)} (see kubectl get wcn)", generation,
        )  # fmt: skip
    else:
        degraded = condition(C.DEGRADED, False, R.AS_EXPECTED, "", generation)
    return WeightCacheStatus(
        observed_generation=generation,
        desired_nodes=desired_nodes,
        ready_nodes=ready,
        stale_nodes=stale,
        model_count=len(spec.models),
        models=residency,
        adapters=adapters,
        conditions=[ready_cond, degraded]
        + ([] if gpu_mismatch is None else [gpus_match_condition(gpu_mismatch, generation)]),
    )


def node_warm_labels(wcns: list[dict[str, Any]]) -> dict[str, str]:
    """The warm.keepwarm.dev/* labels one node should carry, from its WeightCacheNodes."""
    labels = {}
    for body in wcns:
        status = WeightCacheNodeStatus.model_validate(body.get("status") or {})
        for model in status.resident():
            labels[warm_label_key(body["spec"]["weightCache"], model)] = "true"
    return labels


def inference_status(
    generation: int,
    selector: str,
    deployment: dict[str, Any] | None,
    desired: int,
    cache_condition: Condition,
    warm_nodes: int,
    problem: Condition | None = None,
) -> InferenceDeploymentStatus:
    """Available/Progressing from the Deployment's status (or the LeaderWorkerSet's: a group counts
    once its leader and workers are Ready); CacheWarm as judged by the handler."""
    C, R = IDepConditionType, IDepReason
    dstatus = (deployment or {}).get("status") or {}
    replicas = dstatus.get("replicas", 0)
    ready = dstatus.get("readyReplicas", 0)
    # a LeaderWorkerSet reports no availableReplicas: a Ready group serves
    groups = deployment is not None and deployment.get("kind") == lws.KIND
    available = ready if groups else dstatus.get("availableReplicas", 0)
    updated = dstatus.get("updatedReplicas", 0)
    current = deployment is not None and dstatus.get("observedGeneration", 0) >= deployment["metadata"].get(
        "generation", 0
    )
    if problem is not None:
        available_cond = condition(C.AVAILABLE, False, problem.reason, problem.message, generation)
        progressing = problem.model_copy(update={"type": C.PROGRESSING})
    else:
        if desired == 0:
            available_cond = condition(
                C.AVAILABLE, True, R.SCALED_TO_ZERO, "scaled to zero replicas", generation
            )
        elif available >= desired:
            available_cond = condition(
                C.AVAILABLE, True, R.MINIMUM_REPLICAS, f"{available}/{desired} replicas available", generation
            )
        else:
            available_cond = condition(
                C.AVAILABLE,
                False,
                R.REPLICAS_UNAVAILABLE,
                f"{available}/{desired} replicas available",
                generation,
            )
        done = current and updated >= desired and replicas == updated and ready >= desired
        if done:
            progressing = condition(
                C.PROGRESSING, False, R.ROLLED_OUT, "all replicas run the current spec", generation
            )
        else:
            progressing = condition(
                C.PROGRESSING, True, R.ROLLING, f"{updated}/{desired} updated, {ready} ready", generation
            )
    return InferenceDeploymentStatus(
        observed_generation=generation,
        replicas=replicas,
        ready_replicas=ready,
        updated_replicas=updated,
        selector=selector,
        warm_nodes=warm_nodes,
        conditions=[available_cond, progressing, cache_condition],
    )
