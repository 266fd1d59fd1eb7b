"""What this operator applied, and the one apply-if-changed path every child goes through.

`AppliedStore` remembers, per child (apiVersion, kind, namespace, name), what our last server-side
apply returned (resourceVersion, generation) and the digest of the manifest we applied. `apply_if_changed`
reads it: a child whose manifest is the one applied then, and which nobody changed since, costs a read
(or nothing, when the caller already holds the object) instead of a write. Drift, someone editing or
deleting our child, is a changed resourceVersion, or for kinds whose controller writes their status
all the time (GENERATION_TRACKED), a changed generation.

`ApplyMode` says what a reconcile does with its children.
"""

from __future__ import annotations

import enum
import hashlib
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from keepwarm_api import lws
from keepwarm_api.kube import Kube

Key = tuple[str, str, str, str]  # (apiVersion, kind, namespace or "", name)
# Kinds whose status is written often by others (the Deployment controller, the node agents): only a
# new generation (a spec change) or deletion counts as drift, not every resourceVersion.
GENERATION_TRACKED = frozenset({"Deployment", lws.KIND, "WeightCacheNode"})


class ApplyMode(enum.Enum):
    """What a reconcile does with its children."""

    APPLY = "apply"  # create/update/resume: apply every child whose manifest or object changed
    RESYNC = "resync"  # timer, drift event: the same, reading the children it already holds
    STATUS_ONLY = "status-only"  # an event moved only status: recompute it, apply nothing


class Unread(enum.Enum):
    UNREAD = "unread"


UNREAD = Unread.UNREAD  # apply_if_changed's `current` when the caller has not read the object


@dataclass(frozen=True)
class Applied:
    """One child as our last apply of it left it."""

    resource_version: str  # what the apply returned
    generation: int  # what the apply returned (0: the kind has none)
    digest: str  # sha256 of the manifest applied (manifest_digest)

    def drifted(self, kind: str, current: dict[str, Any]) -> bool:
        """Whether someone changed the object since (a deleted one is None, not passed here)."""
        meta = current["metadata"]
        if kind in GENERATION_TRACKED:
            return meta.get("generation", 0) != self.generation
        return meta.get("resourceVersion") != self.resource_version


def key_of(obj: dict[str, Any]) -> Key:
    meta = obj["metadata"]
    return (obj["apiVersion"], obj["kind"], meta.get("namespace") or "", meta["name"])


def manifest_digest(manifest: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()


class AppliedStore:
    """Key -> Applied, shared by handler threads (kopf's workers and the coalescer's pool)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: dict[Key, Applied] = {}

    def get(self, key: Key) -> Applied | None:
        with self._lock:
            return self._records.get(key)

    def record(self, key: Key, obj: dict[str, Any], digest: str) -> Applied:
        """Remember `obj` (what an apply returned, or an object found as we would apply it)."""
        meta = obj.get("metadata") or {}
        applied = Applied(meta.get("resourceVersion", ""), meta.get("generation", 0), digest)
        with self._lock:
            self._records[key] = applied
        return applied

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)


def apply_if_changed(
    kube: Kube, store: AppliedStore, manifest: dict[str, Any],
    current: dict[str, Any] | Unread | None = UNREAD, *,
    matches: Callable[[dict[str, Any]], bool] | None = None, manager: str | None = None,
) -> tuple[dict[str, Any] | None, bool]:  # fmt: skip
    """Server-side apply `manifest` unless neither side changed since our last apply of it.

    `current`: the object as the caller last read it (None: known to be absent); UNREAD reads it,
    only when the store has a record to compare with (no record, or a new manifest: apply at once).
    `matches`: whether an object the store cannot vouch for (a restart: no record) already is what
    we would apply; it is then recorded and not written. Returns (the object as the server has it,
    whether we wrote); the object is None only when it is absent and unwritten.
    """
    key, digest = key_of(manifest), manifest_digest(manifest)
    known = store.get(key)
    if (known is not None and known.digest == digest) or (matches is not None and current is not UNREAD):
        if current is UNREAD:
            meta = manifest["metadata"]
            current = kube.get(manifest["apiVersion"], manifest["kind"], meta["name"], meta.get("namespace"))
        if current is not None:
            if known is not None and known.digest == digest and not known.drifted(key[1], current):
                return current, False
            if matches is not None and matches(current):
                store.record(key, current, digest)
                return current, False
    result = kube.apply(manifest, manager=manager)
    store.record(key, result, digest)
    return result, True
