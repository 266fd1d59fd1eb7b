"""Names, labels and owner references shared by the children the operator creates."""

from __future__ import annotations

import hashlib
from typing import Any

from keepwarm_api import GROUP
from keepwarm_api.group import CACHE_LABEL

MANAGED_BY = {"app.kubernetes.io/managed-by": "keepwarm-operator"}
IDEP_LABEL = f"{GROUP}/inferencedeployment"  # value: InferenceDeployment name
WARM_LABEL_PREFIX = f"warm.{GROUP}/"  # node label: warm.keepwarm.dev/<cache>.<model> = "true"
GPU_RESOURCE = "nvidia.com/gpu"  # the device plugin's extended resource: pods' limits, Nodes' allocatable


def agent_name(cache: str) -> str:
    return f"keepwarm-agent-{cache}"


def agent_labels(cache: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "keepwarm-agent",
        "app.kubernetes.io/instance": cache,
        CACHE_LABEL: cache,
    }


def runtime_labels(idep: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "keepwarm-runtime",
        "app.kubernetes.io/instance": idep,
        IDEP_LABEL: idep,
    }


def selector_string(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def warm_label_key(cache: str, model: str) -> str:
    """Node label meaning "this cache holds this model here"; names past 63 chars get a hash suffix."""
    name = f"{cache}.{model}"
    if len(name) > 63:
        digest = hashlib.sha256(name.encode()).hexdigest()[:10]
        name = f"{name[:52].rstrip('.-')}-{digest}"
    return WARM_LABEL_PREFIX + name


def owner_reference(owner: dict[str, Any]) -> dict[str, Any]:
    """Controller owner reference to a custom resource body, so deleting it garbage-collects us."""
    return {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def object_meta(
    name: str, labels: dict[str, str], owner: dict[str, Any] | None, namespace: str | None = None
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": {**labels, **MANAGED_BY}}
    if namespace:
        meta["namespace"] = namespace
    if owner is not None:
        meta["ownerReferences"] = [owner_reference(owner)]
    return meta
