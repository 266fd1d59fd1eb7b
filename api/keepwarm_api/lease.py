"""The node agent's liveness: one coordination.k8s.io/v1 Lease per WeightCacheNode (as kubelets do for
Nodes), in the agent's namespace, named like its WeightCacheNode and labelled with its cache.

The agent renews it every heartbeatSeconds; the operator lists a cache's Leases (by label) on each
resync and marks a WeightCacheNode Stale when its Lease stopped being renewed. A renewal writes only
this small object, so the WeightCacheNode itself is written only when its status changes, and nothing
watching WeightCacheNodes (the operator, kopf's indices) wakes up on heartbeats. The Lease is owned by
its WeightCacheNode, so the garbage collector removes it with that.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from .group import API_VERSION, CACHE_LABEL
from .weightcachenode import KIND as NODE_KIND

LEASE_API_VERSION = "coordination.k8s.io/v1"
LEASE_KIND = "Lease"
LEASE_GROUP = "coordination.k8s.io"


def micro_time(t: dt.datetime) -> str:
    """A Kubernetes MicroTime (RFC 3339 with microseconds, UTC)."""
    return t.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(value: str) -> dt.datetime:
    """A Kubernetes Time or MicroTime as an aware datetime."""
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))


def renewal(now: dt.datetime, holder: str, duration_s: int) -> dict[str, Any]:
    """The merge patch of one renewal (holder: the node; duration: when the operator calls it Stale)."""
    return {
        "spec": {
            "holderIdentity": holder,
            "leaseDurationSeconds": duration_s,
            "renewTime": micro_time(now),
        }
    }


def node_lease(
    name: str, namespace: str, cache: str, holder: str, duration_s: int, now: dt.datetime,
    owner: dict[str, Any] | None,
) -> dict[str, Any]:  # fmt: skip
    """The Lease an agent creates on its first renewal; `owner` is its WeightCacheNode as read (its
    uid makes the Lease go with it). No blockOwnerDeletion: that would need update on the owner."""
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": {CACHE_LABEL: cache}}
    if owner is not None and owner.get("metadata", {}).get("uid"):
        meta["ownerReferences"] = [
            {
                "apiVersion": API_VERSION,
                "kind": NODE_KIND,
                "name": owner["metadata"]["name"],
                "uid": owner["metadata"]["uid"],
            }
        ]
    body = renewal(now, holder, duration_s)
    body["spec"]["acquireTime"] = micro_time(now)
    return {"apiVersion": LEASE_API_VERSION, "kind": LEASE_KIND, "metadata": meta, **body}


def renewed_at(lease: dict[str, Any]) -> dt.datetime | None:
    """When a Lease was last renewed (None if never)."""
    value = (lease.get("spec") or {}).get("renewTime")
    return parse_time(value) if value else None
