"""The operator's status writes outside kopf carry the resourceVersion they were computed from: on the
real API server a write computed from a stale read gets 409 and is recomputed from a fresh one."""

from __future__ import annotations

import json
import uuid

from keepwarm_api import API_VERSION
from keepwarm_testing.operator import GROUP_PATH, get, install_crds


def test_a_status_computed_from_a_stale_read_is_recomputed_not_written(control_plane):
    cp = control_plane
    install_crds(cp)
    name = f"kwrv{uuid.uuid4().hex[:5]}.node"
    wcn = {
        "apiVersion": API_VERSION,
        "kind": "WeightCacheNode",
        "metadata": {"name": name},
        "spec": {"weightCache": "kwrv", "nodeName": "node"},
    }  # no cache label and no operator here: only this test writes it
    cp.kubectl("apply", "-f", "-", input=json.dumps(wcn))
    kube = cp.kube()
    try:
        stale = kube.get(API_VERSION, "WeightCacheNode", name)
        fresh = {"status": {"message": "fresh"}}
        cp.kubectl("patch", "wcn", name, "--subresource=status", "--type=merge", "-p", json.dumps(fresh))
        seen: list[str] = []

        def compute(body):
            message = (body.get("status") or {}).get("message", "nothing")
            seen.append(message)
            return {"message": f"computed from {message}"}

        assert kube.write_status(API_VERSION, "WeightCacheNode", name, None, compute, stale)
        assert seen == ["nothing", "fresh"]  # the stale computation got 409; the fresh one landed
        assert get(cp, f"{GROUP_PATH}/weightcachenodes/{name}")["status"]["message"] == "computed from fresh"
        assert kube.write_status(API_VERSION, "WeightCacheNode", name, None, lambda body: None)  # no write
        assert not kube.write_status(API_VERSION, "WeightCacheNode", "gone.node", None, compute)
    finally:
        cp.kubectl("delete", "wcn", name, check=False)
