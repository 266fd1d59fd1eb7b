"""Warm-node labels: warm.keepwarm.dev/<cache>.<model>=true on each Node holding a model.

Runtime pods prefer nodes with their label. Labels are server-side applied under their own field
manager, so applying the current set removes the ones no longer true (including those of deleted
caches) without touching anyone else's labels; no finalizer is needed.
"""

from __future__ import annotations

from typing import Any

import kopf

from ..api import API_VERSION
from ..api.weightcachenode import KIND as NODE_KIND
from ..api.weightcachenode import PLURAL
from ..kube import ApiError
from ..metrics import reconciling
from ..status import node_warm_labels
from .setup import context

GROUP, VERSION = API_VERSION.split("/")
LABEL_MANAGER = "keepwarm-operator-warm-labels"


def sync_node_labels(kube: Any, node: str) -> dict[str, str]:
    wcns = [o for o in kube.list(API_VERSION, NODE_KIND) if o["spec"]["nodeName"] == node]
    labels = node_warm_labels(wcns)
    patch = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node, "labels": labels}}
    try:
        kube.apply(patch, manager=LABEL_MANAGER)
    except ApiError as exc:
        if exc.status != 404:  # a vanished node needs no labels
            raise
    return labels


@kopf.on.event(GROUP, VERSION, PLURAL)
def weightcachenode_changed(body: kopf.Body, memo: Any, **_: Any) -> None:
    node = (body.get("spec") or {}).get("nodeName")
    if node:
        with reconciling(NODE_KIND, "event"):
            sync_node_labels(context(memo).kube, node)
