"""WeightCacheNodes: kopf's residency index, and warm-node labels warm.keepwarm.dev/<cache>.<model>=true
on each Node holding a model.

Runtime pods prefer nodes with their label. Labels are server-side applied under their own field
manager, so applying the current set removes the ones no longer true (including those of deleted
caches) without touching anyone else's labels; no finalizer is needed.
"""

from __future__ import annotations

from typing import Any

import kopf

from keepwarm_api import API_VERSION
from keepwarm_api.weightcachenode import KIND as NODE_KIND
from keepwarm_api.weightcachenode import PLURAL, WeightCacheNodeStatus

from ..kube import ApiError
from ..metrics import reconciling
from ..status import node_warm_labels
from .inference import refresh_for_cache
from .setup import context
from .weightcache import refresh_status

GROUP, VERSION = API_VERSION.split("/")
LABEL_MANAGER = "keepwarm-operator-warm-labels"


def sync_node_labels(kube: Any, node: str) -> dict[str, str]:
    wcns = [o for o in kube.list(API_VERSION, NODE_KIND) if o["spec"]["nodeName"] == node]
    labels = node_warm_labels(wcns)
    if kube.get("v1", "Node", node) is None:  # gone: apply would try to create it
        return labels
    patch = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node, "labels": labels}}
    try:
        kube.apply(patch, manager=LABEL_MANAGER)
    except ApiError as exc:
        if exc.status not in (403, 404):  # deleted meanwhile (apply then means create: forbidden)
            raise
    return labels


def _resident(body: kopf.Body) -> frozenset[str]:
    return frozenset(WeightCacheNodeStatus.model_validate(body.get("status") or {}).resident())


@kopf.index(GROUP, VERSION, PLURAL)
def residency(body: kopf.Body, **_: Any) -> dict[str, frozenset[str]]:
    """WeightCache name -> the models resident on this node (kopf keeps one value per WeightCacheNode)."""
    cache = (body.get("spec") or {}).get("weightCache")
    return {cache: _resident(body)} if cache else {}


@kopf.on.event(GROUP, VERSION, PLURAL)
def weightcachenode_changed(body: kopf.Body, type: str | None, memo: Any, **_: Any) -> None:
    """On a change of residency (not every heartbeat): node labels, cache status, its deployments.

    `memo` is kopf's per-object memo here: it remembers this node's residency as last acted on.
    """
    spec = body.get("spec") or {}
    node, cache = spec.get("nodeName"), spec.get("weightCache")
    if not node or not cache:
        return
    ctx = context(memo)
    resident = frozenset() if type == "DELETED" else _resident(body)
    changed = memo.get("resident", frozenset()) != resident  # a new, empty node changes nothing
    memo["resident"] = resident
    if not changed:
        return
    with reconciling(NODE_KIND, "event"):
        sync_node_labels(ctx.kube, node)

    def refresh() -> None:  # also after the initial listing: resumed deployments may have counted early
        refresh_status(memo, cache)
        refresh_for_cache(memo, cache, apply=False)

    ctx.coalesce(cache, refresh)
