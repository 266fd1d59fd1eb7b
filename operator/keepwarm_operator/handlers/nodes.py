"""WeightCacheNodes: kopf's indices (residency per cache, warm labels per node), and the warm-node
labels warm.keepwarm.dev/<cache>.<model>=true on each Node holding a model, rebuilt at start.

Runtime pods prefer nodes with their label. Labels are server-side applied under their own field
manager, so applying the current set removes the ones no longer true (including those of deleted
caches) without touching anyone else's labels; no finalizer is needed.
"""

from __future__ import annotations

from typing import Any

import kopf

from keepwarm_api import API_VERSION
from keepwarm_api.kube import ApiError, Kube
from keepwarm_api.weightcachenode import KIND as NODE_KIND
from keepwarm_api.weightcachenode import PLURAL

from ..applied import AppliedStore, apply_if_changed
from ..builders.meta import WARM_LABEL_PREFIX
from ..metrics import reconciling
from ..status import node_warm_labels, resident_models
from .setup import context, residency_moved

GROUP, VERSION = API_VERSION.split("/")
LABEL_MANAGER = "keepwarm-operator-warm-labels"


def current_warm_labels(node: dict[str, Any]) -> dict[str, str]:
    labels = node["metadata"].get("labels") or {}
    return {k: v for k, v in labels.items() if k.startswith(WARM_LABEL_PREFIX)}


def apply_node_labels(
    kube: Kube,
    applied: AppliedStore,
    node: str,
    labels: dict[str, str],
    current: dict[str, Any] | None = None,
) -> bool:
    """Give `node` exactly these warm labels; no write when it already has them. False when gone.
    `current`: the Node as the caller just listed it (read when None)."""
    current = current or kube.get("v1", "Node", node)
    if current is None:  # gone: apply would try to create it
        return False
    patch = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node, "labels": labels}}
    try:
        apply_if_changed(
            kube,
            applied,
            patch,
            current,
            matches=lambda n: current_warm_labels(n) == labels,
            manager=LABEL_MANAGER,
        )
    except ApiError as exc:
        if exc.status not in (403, 404):  # deleted meanwhile (apply then means create: forbidden)
            raise
        return False
    return True


def sync_node_labels(kube: Kube, applied: AppliedStore, node: str, warm: kopf.Index) -> dict[str, str]:
    """The node's labels from kopf's index of WeightCacheNodes (no listing)."""
    labels: dict[str, str] = {}
    for wcn_labels in list(warm.get(node, ())):
        labels |= wcn_labels
    apply_node_labels(kube, applied, node, labels)
    return labels


@kopf.on.startup()
def rebuild_warm_labels(memo: Any, **_: Any) -> None:
    """Labels from the WeightCacheNodes as they are now: catches up on whatever changed (or was
    deleted) while no operator ran, including nodes whose caches hold nothing any more."""
    ctx = context(memo)
    kube = ctx.kube
    by_node: dict[str, list[dict[str, Any]]] = {}
    for wcn in kube.list(API_VERSION, NODE_KIND):
        by_node.setdefault(wcn["spec"]["nodeName"], []).append(wcn)
    for node in kube.list("v1", "Node"):
        name = node["metadata"]["name"]
        apply_node_labels(kube, ctx.applied, name, node_warm_labels(by_node.get(name, [])), node)


@kopf.index(GROUP, VERSION, PLURAL)
async def warm_labels(body: kopf.Body, **_: Any) -> dict[str, dict[str, str]]:
    """Node name -> the warm labels this WeightCacheNode asks for."""
    node = (body.get("spec") or {}).get("nodeName")
    return {node: node_warm_labels([dict(body)])} if node else {}


@kopf.index(GROUP, VERSION, PLURAL)
async def residency(body: kopf.Body, **_: Any) -> dict[str, frozenset[str]]:
    """WeightCache name -> the models resident on this node (kopf keeps one value per WeightCacheNode)."""
    cache = (body.get("spec") or {}).get("weightCache")
    return {cache: resident_models(body)} if cache else {}


@kopf.on.event(GROUP, VERSION, PLURAL)
async def weightcachenode_changed(
    body: kopf.Body, type: str | None, memo: Any, warm_labels: kopf.Index, **_: Any
) -> None:
    """On a change of residency (not every heartbeat): the node's warm labels. (The cache's status
    and its InferenceDeployments follow from their own modules' handlers of these events.)

    `memo` is kopf's per-object memo here: it remembers this node's residency as last acted on.
    Async and non-blocking: the API calls run on the coalescer's pool, so the events of 200 nodes
    do not each take a turn on kopf's worker pool.
    """
    node = (body.get("spec") or {}).get("nodeName")
    if not node or not residency_moved(body, type, memo, "labels"):
        return
    ctx = context(memo)

    def labels() -> None:  # from the index as it is when this runs: the latest of a burst
        with reconciling(NODE_KIND, "event"):
            sync_node_labels(ctx.kube, ctx.applied, node, warm_labels)

    ctx.coalesce(f"labels/{node}", labels, delay_s=0.0)
