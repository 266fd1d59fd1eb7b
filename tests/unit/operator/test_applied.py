"""applied.py: one apply-if-changed path; a quiet child costs a read (or nothing), drift a write."""

from __future__ import annotations

import copy
from typing import Any

from keepwarm_operator.applied import AppliedStore, apply_if_changed, key_of


class FakeKube:
    """Objects by key; apply bumps resourceVersion and, on a spec change, generation."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, ...], dict[str, Any]] = {}
        self.calls: list[str] = []
        self.rv = 0

    def get(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> Any:
        self.calls.append("get")
        obj = self.objects.get((api_version, kind, namespace or "", name))
        return copy.deepcopy(obj)

    def apply(self, obj: dict[str, Any], *, manager: str | None = None) -> dict[str, Any]:
        self.calls.append("apply")
        key = key_of(obj)
        old = self.objects.get(key)
        gen = (old or {}).get("metadata", {}).get("generation", 0)
        if old is None or old.get("spec") != obj.get("spec"):
            gen += 1
        self.objects[key] = self.touch(copy.deepcopy(obj), generation=gen)
        return copy.deepcopy(self.objects[key])

    def touch(self, obj: dict[str, Any], **meta: Any) -> dict[str, Any]:
        """Someone else wrote it (a new resourceVersion)."""
        self.rv += 1
        obj["metadata"].update(meta, resourceVersion=str(self.rv))
        self.objects[key_of(obj)] = obj
        return obj


def manifest(kind: str = "Service", spec: Any = 1) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": kind, "metadata": {"name": "a", "namespace": "ns"}, "spec": spec}


def test_unchanged_costs_a_read_and_no_write():
    kube, store = FakeKube(), AppliedStore()
    assert apply_if_changed(kube, store, manifest())[1]  # no record: applied without a read
    assert kube.calls == ["apply"]
    obj, wrote = apply_if_changed(kube, store, manifest())
    assert not wrote and obj is not None and kube.calls == ["apply", "get"]
    obj, wrote = apply_if_changed(kube, store, manifest(), obj)  # held by the caller: no read
    assert not wrote and kube.calls == ["apply", "get"]


def test_new_manifest_edit_and_deletion_are_applied():
    kube, store = FakeKube(), AppliedStore()
    apply_if_changed(kube, store, manifest())
    assert apply_if_changed(kube, store, manifest(spec=2))[1]  # a new manifest: no read first
    assert kube.calls == ["apply", "apply"]
    kube.touch(kube.objects[key_of(manifest())])  # someone edited it
    assert apply_if_changed(kube, store, manifest(spec=2))[1]
    del kube.objects[key_of(manifest())]
    assert apply_if_changed(kube, store, manifest(spec=2))[1]


def test_generation_tracked_kinds_ignore_status_writes():
    kube, store = FakeKube(), AppliedStore()
    deployment = apply_if_changed(kube, store, manifest("Deployment"))[0]
    assert deployment is not None
    busy = kube.touch(deployment)  # the controller wrote status: new resourceVersion, same generation
    assert not apply_if_changed(kube, store, manifest("Deployment"), busy)[1]
    edited = kube.touch(busy, generation=busy["metadata"]["generation"] + 1)
    assert apply_if_changed(kube, store, manifest("Deployment"), edited)[1]


def test_matches_adopts_an_object_without_a_record():
    kube, store = FakeKube(), AppliedStore()
    existing = kube.apply(manifest())  # an earlier operator process applied it
    obj, wrote = apply_if_changed(kube, store, manifest(), existing, matches=lambda o: o["spec"] == 1)
    assert not wrote and obj == existing and len(store) == 1
    assert apply_if_changed(kube, store, manifest(spec=3), existing, matches=lambda o: o["spec"] == 3)[1]
