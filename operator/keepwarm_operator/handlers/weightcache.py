"""WeightCache: agents' DaemonSet and RBAC, one WeightCacheNode per agent node, aggregated status.

Reconcile, in order:
  1. validate the spec (the CRD schema already did; what it cannot judge becomes a condition)
  2. apply ServiceAccount, ClusterRole(+Binding) and DaemonSet, owned by the WeightCache (only those
     changed, on either side, since our last apply: a resync of a quiet cache writes nothing)
  3. ensure a WeightCacheNode for every selected node an agent pod is bound to, its spec holding the
     cache's models (the agent on that node watches it; the DaemonSet never changes for models)
  4. delete WeightCacheNodes whose Node is gone or no longer selected; mark Stale those whose agent's
     Lease (keepwarm_api.lease, renewed every heartbeat) stopped being renewed
  5. aggregate the WeightCacheNodes into status
Status is aggregated again whenever a WeightCacheNode's resident models change (this module's handler
of their events), and every resync period.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import kopf
from pydantic import ValidationError

from keepwarm_api import API_VERSION
from keepwarm_api.common import condition, merge_conditions, upsert_conditions
from keepwarm_api.kube import ApiError, Kube
from keepwarm_api.lease import LEASE_API_VERSION, LEASE_KIND, renewed_at
from keepwarm_api.weightcache import (
    KIND,
    PLURAL,
    Tier,
    WeightCacheConditionType,
    WeightCacheReason,
    WeightCacheSpec,
)
from keepwarm_api.weightcachenode import (
    HEARTBEAT_MISSED,
    STALE,
    NodePhase,
    WeightCacheNodeSpec,
    WeightCacheNodeStatus,
    node_spec,
    object_name,
)
from keepwarm_api.weightcachenode import KIND as NODE_KIND
from keepwarm_api.weightcachenode import PLURAL as NODE_PLURAL

from ..applied import AppliedStore, ApplyMode, apply_if_changed
from ..builders.agent import agent_children
from ..builders.meta import CACHE_LABEL, agent_labels, agent_name, object_meta, selector_string
from ..metrics import APPLIES, STALE_NODES, reconciling
from ..status import (
    gpu_mismatches,
    is_stale,
    last_heard,
    node_belongs,
    node_gpus,
    now,
    status_changed,
    weightcache_status,
)
from .setup import context, residency_moved

GROUP, VERSION = API_VERSION.split("/")


def _parse_time(value: str) -> dt.datetime:
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))


def _spec_of(obj: dict[str, Any]) -> WeightCacheNodeSpec | None:
    """The typed spec of a WeightCacheNode as stored (None if an older operator wrote another shape)."""
    try:
        return WeightCacheNodeSpec.model_validate(obj.get("spec") or {})
    except ValidationError:
        return None


def _sync_nodes(
    kube: Kube, applied: AppliedStore, body: dict[str, Any], spec: WeightCacheSpec, agent_ns: str
) -> tuple[list[WeightCacheNodeStatus], list[str] | None]:
    """Steps 3-4: WeightCacheNodes follow the agent pods; returns the live ones' statuses and, on
    tier gpu, the nodes whose agent sees another GPU count than the Node offers (gpu_mismatches)."""
    cache = body["metadata"]["name"]
    selected = kube.list("v1", "Node", labels=selector_string(spec.node_selector) or None)  # targeted
    node_labels = {n["metadata"]["name"]: n["metadata"].get("labels") or {} for n in selected}
    offered = {n["metadata"]["name"]: node_gpus(n) for n in selected}
    del selected  # 200 whole Nodes: only their labels and GPU counts are needed from here on
    pods = kube.list("v1", "Pod", agent_ns, selector_string(agent_labels(cache)))
    agent_nodes = {
        p["spec"]["nodeName"]
        for p in pods
        if p["spec"].get("nodeName") and not p["metadata"].get("deletionTimestamp")
    }
    existing = {
        o["metadata"]["name"]: o for o in kube.list(API_VERSION, NODE_KIND, labels=f"{CACHE_LABEL}={cache}")
    }
    renewed = {  # the agents' Leases, named like their WeightCacheNodes
        lease["metadata"]["name"]: renewed_at(lease)
        for lease in kube.list(LEASE_API_VERSION, LEASE_KIND, agent_ns, labels=f"{CACHE_LABEL}={cache}")
    }
    for node in sorted(n for n in agent_nodes if node_belongs(node_labels.get(n), spec.node_selector)):
        name = object_name(cache, node)
        desired = node_spec(cache, node, spec)
        wcn = {
            "apiVersion": API_VERSION,
            "kind": NODE_KIND,
            "metadata": object_meta(name, {CACHE_LABEL: cache}, body),
            "spec": desired.wire(),
        }
        new_node = name not in existing
        obj, wrote = apply_if_changed(  # the listing holds it: no read; a restart adopts a match
            kube, applied, wcn, existing.get(name), matches=lambda o, d=desired: _spec_of(o) == d
        )
        if not wrote:
            continue
        existing[name] = obj or wcn
        APPLIES.labels(NODE_KIND).inc()
        if new_node:
            kopf.event(
                body,
                type="Normal",
                reason="NodeAdded",
                message=f"agent scheduled on {node}; created WeightCacheNode {name}",
            )
    at, reports = now(), []  # (node, its WeightCacheNode's status) of the live ones
    for name, obj in existing.items():
        node = obj["spec"]["nodeName"]
        if not node_belongs(node_labels.get(node), spec.node_selector):
            kube.delete(API_VERSION, NODE_KIND, name)
            why = "is gone or no longer matches spec.nodeSelector"  # the list holds selected nodes only
            kopf.event(
                body,
                type="Normal",
                reason="NodeRemoved",
                message=f"node {node} {why}; deleted WeightCacheNode {name}",
            )
            continue
        status = WeightCacheNodeStatus.model_validate(obj.get("status") or {})
        created = _parse_time(obj["metadata"]["creationTimestamp"])
        last = last_heard(status, renewed.get(name), created)
        if status.phase != NodePhase.STALE and is_stale(last, spec.heartbeat_seconds, at):
            since = "creation" if last == created else last.isoformat().replace("+00:00", "Z")
            message = f"no heartbeat since {since} (agents report every {spec.heartbeat_seconds}s)"
            stale = condition(STALE, True, HEARTBEAT_MISSED, message, None)
            # The agent's own conditions stay (why its daemon did not start, refused clients).
            conditions = upsert_conditions((obj.get("status") or {}).get("conditions"), [stale], at)
            patch = {
                # Precondition: an agent that reported since we read the object wins (409, no write).
                "metadata": {"resourceVersion": obj["metadata"]["resourceVersion"]},
                "status": {"phase": NodePhase.STALE.value, "message": message, "conditions": conditions},
            }
            try:
                kube.merge_patch(API_VERSION, NODE_KIND, name, patch, status=True)
            except ApiError as exc:
                if exc.status != 409:
                    raise  # 409: a fresh heartbeat arrived, not stale
            else:
                kopf.warn(body, reason="NodeStale", message=f"{node}: {message}")
                status = status.model_copy(update={"phase": NodePhase.STALE})
        reports.append((node, status))
    statuses = [status for _, status in reports]
    STALE_NODES.labels(cache).set(sum(1 for s in statuses if s.phase == NodePhase.STALE))
    return statuses, gpu_mismatches(reports, offered) if spec.tier == Tier.GPU else None


class ApplyFailed(Exception):
    """Applying children failed; carries the status to write anyway (Degraded/ApplyFailed)."""

    def __init__(self, message: str, status: dict[str, Any]):
        super().__init__(message)
        self.status = status


def reconcile(
    body: dict[str, Any], memo: Any, trigger: str, mode: ApplyMode = ApplyMode.APPLY
) -> dict[str, Any]:
    """Steps 1-5; returns the new status. STATUS_ONLY skips step 2 (status refresh from an event);
    APPLY and RESYNC apply the agent's objects that changed on either side since our last apply."""
    ctx = context(memo)
    name, generation = body["metadata"]["name"], body["metadata"].get("generation", 0)
    old_conditions = (body.get("status") or {}).get("conditions")
    with reconciling(KIND, trigger):
        try:
            spec = WeightCacheSpec.model_validate(body.get("spec") or {})
        except ValidationError as exc:  # 1: only reachable if the CRD is older than the operator
            reason = WeightCacheReason.INVALID_SPEC
            bad = condition(WeightCacheConditionType.READY, False, reason, str(exc), generation)
            return {
                "observedGeneration": generation,
                "conditions": merge_conditions(old_conditions, [bad], now()),
            }
        if mode is not ApplyMode.STATUS_ONLY:  # 2
            try:
                for child in agent_children(name, spec, ctx.agent_namespace, body):
                    if apply_if_changed(ctx.kube, ctx.applied, child)[1]:  # a read when unchanged
                        APPLIES.labels(child["kind"]).inc()
            except ApiError as exc:
                reason = WeightCacheReason.APPLY_FAILED
                message = (
                    f"applying the agent's objects failed: {exc} (check operator RBAC and agent namespace)"
                )
                degraded = condition(WeightCacheConditionType.DEGRADED, True, reason, message, generation)
                kopf.warn(body, reason=reason.value, message=message)
                raise ApplyFailed(
                    message, {"conditions": merge_conditions(old_conditions, [degraded], now())}
                ) from exc
        ds = ctx.kube.get("apps/v1", "DaemonSet", agent_name(name), ctx.agent_namespace) or {}
        desired = (ds.get("status") or {}).get("desiredNumberScheduled", 0)
        with ctx.node_lock(name):
            nodes, gpu_mismatch = _sync_nodes(ctx.kube, ctx.applied, body, spec, ctx.agent_namespace)  # 3, 4
        status = weightcache_status(spec, generation, desired, nodes, gpu_mismatch)  # 5
        wire = status.wire()
        wire["conditions"] = merge_conditions(old_conditions, status.conditions, now())
        was_ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in old_conditions or [])
        if status.conditions[0].status.value == "True" and not was_ready:
            kopf.event(body, type="Normal", reason="Ready", message=status.conditions[0].message)
        return wire


def _run(body: kopf.Body, patch: kopf.Patch, memo: Any, trigger: str, mode: ApplyMode) -> None:
    try:
        status = reconcile(dict(body), memo, trigger, mode)
        if status_changed(body.get("status"), status):
            patch.status.update(status)
    except ApplyFailed as exc:
        patch.status.update(exc.status)
        raise kopf.TemporaryError(str(exc), delay=max(5.0, context(memo).resync_seconds)) from exc


def refresh_status(memo: Any, cache: str) -> None:
    """Re-aggregate one WeightCache's status now (a node's residency changed)."""

    def compute(body: dict[str, Any]) -> dict[str, Any] | None:
        status = reconcile(body, memo, "node", ApplyMode.STATUS_ONLY)
        return status if status_changed(body.get("status"), status) else None

    context(memo).kube.write_status(API_VERSION, KIND, cache, None, compute)


@kopf.on.event(GROUP, VERSION, NODE_PLURAL)
async def node_residency_changed(body: kopf.Body, type: str | None, memo: Any, **_: Any) -> None:
    """A node's resident models changed (not every heartbeat): re-aggregate its cache's status, on
    the coalescer's pool (one refresh per burst). `memo` is kopf's per-object memo of the node."""
    cache = (body.get("spec") or {}).get("weightCache")
    if not cache or not residency_moved(body, type, memo, "weightcache"):
        return
    ctx = context(memo)
    ctx.coalesce(f"weightcache/{cache}", lambda: refresh_status(memo, cache))


@kopf.index(GROUP, VERSION, PLURAL)
async def caches(body: kopf.Body, name: str, **_: Any) -> dict[str, dict[str, Any]]:
    """WeightCache name -> the object as kopf's watch last saw it (InferenceDeployments read it per
    event; an API round trip each would sit on every create's path to its Deployment). Index
    functions are async: pure and quick, they need no hop through kopf's worker pool."""
    return {name: dict(body)}


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
@kopf.on.resume(GROUP, VERSION, PLURAL)
def on_change(body: kopf.Body, patch: kopf.Patch, memo: Any, reason: str, **_: Any) -> None:
    _run(body, patch, memo, str(reason), ApplyMode.APPLY)


def resync(body: kopf.Body, patch: kopf.Patch, memo: Any, **_: Any) -> None:
    _run(body, patch, memo, "timer", ApplyMode.RESYNC)


def register_resync(interval: float) -> None:
    """The only timer (stale heartbeats need a clock), registered with the configured period.

    kopf guards timers with its finalizer (keepwarm.dev/operator) so it can stop them on deletion;
    nothing else needs one.
    """
    kopf.timer(GROUP, VERSION, PLURAL, interval=interval, initial_delay=min(interval, 5))(resync)
