"""The test control plane itself: a real API server, controllers, scheduler and fake GPU nodes.

Each test uses its own namespace and its own node label, so the session-wide cluster can be shared
with the operator's end-to-end tests.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest

from keepwarm_testing.controlplane.cluster import ControlPlane

pytestmark = pytest.mark.slow


@pytest.fixture
def namespace(control_plane: ControlPlane) -> Iterator[str]:
    name = f"smoke-{uuid.uuid4().hex[:6]}"
    control_plane.kubectl("create", "namespace", name)
    yield name
    control_plane.kubectl("delete", "namespace", name, "--wait=false")


def get_json(cp: ControlPlane, path: str) -> dict:
    resp = cp.http.get(path)
    resp.raise_for_status()
    return resp.json()


def deployment(name: str, replicas: int, gpus: int, pool: str) -> str:
    return json.dumps(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name},
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": {"app": name}},
                "template": {
                    "metadata": {"labels": {"app": name}},
                    "spec": {
                        "nodeSelector": {"pool": pool},
                        "containers": [
                            {
                                "name": "main",
                                "image": "example.invalid/app:1",
                                "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
                            }
                        ],
                    },
                },
            },
        }
    )


def pods(cp: ControlPlane, namespace: str, selector: str) -> list[dict]:
    return get_json(cp, f"/api/v1/namespaces/{namespace}/pods?labelSelector={selector}")["items"]


def test_api_server_answers_with_real_version_and_rbac(control_plane: ControlPlane) -> None:
    version = json.loads(control_plane.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == "v1.37.2"
    assert control_plane.http.get("/readyz").status_code == 200
    roles = get_json(control_plane, "/apis/rbac.authorization.k8s.io/v1/clusterroles")["items"]
    assert "system:kube-scheduler" in {r["metadata"]["name"] for r in roles}


def test_fake_gpu_nodes_are_ready_and_schedulable(control_plane: ControlPlane) -> None:
    pool = f"p{uuid.uuid4().hex[:6]}"
    names = control_plane.add_gpu_nodes(2, labels={"pool": pool}, gpus=4)
    for name in names:
        node = get_json(control_plane, f"/api/v1/nodes/{name}")
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == "4"
        ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"]
        assert ready == "True"
        assert not [t for t in node["spec"].get("taints", []) if t["key"].startswith("node.kubernetes.io/")]


def test_deployment_pods_run_on_gpu_nodes_and_respect_capacity(
    control_plane: ControlPlane, namespace: str
) -> None:
    cp = control_plane
    pool = f"p{uuid.uuid4().hex[:6]}"
    nodes = set(cp.add_gpu_nodes(2, labels={"pool": pool}, gpus=2))
    cp.kubectl("apply", "-n", namespace, "-f", "-", input=deployment("fits", replicas=3, gpus=1, pool=pool))
    cp.wait_for(
        lambda: (
            get_json(cp, f"/apis/apps/v1/namespaces/{namespace}/deployments/fits")["status"].get(
                "readyReplicas"
            )
            == 3
        ),
        what="3 ready replicas",
    )
    running = pods(cp, namespace, "app=fits")
    assert {p["spec"]["nodeName"] for p in running} <= nodes
    assert all(p["status"]["phase"] == "Running" and p["status"]["podIP"] for p in running)

    # 4 GPUs in the pool, 3 taken: a pod asking for 2 more must stay Pending, unschedulable.
    cp.kubectl("apply", "-n", namespace, "-f", "-", input=deployment("toobig", replicas=1, gpus=2, pool=pool))

    def unschedulable() -> bool:
        found = pods(cp, namespace, "app=toobig")
        conds = found[0]["status"].get("conditions", []) if found else []
        return any(c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conds)

    cp.wait_for(unschedulable, what="the 2-GPU pod reported Unschedulable")
    assert pods(cp, namespace, "app=toobig")[0]["status"]["phase"] == "Pending"


def test_garbage_collection_deletes_owned_children(control_plane: ControlPlane, namespace: str) -> None:
    cp = control_plane
    pool = f"p{uuid.uuid4().hex[:6]}"
    cp.add_gpu_nodes(1, labels={"pool": pool})
    cp.kubectl("apply", "-n", namespace, "-f", "-", input=deployment("gc", replicas=2, gpus=1, pool=pool))
    cp.wait_for(lambda: len(pods(cp, namespace, "app=gc")) == 2, what="2 pods")
    assert get_json(cp, f"/apis/apps/v1/namespaces/{namespace}/replicasets?labelSelector=app=gc")["items"]

    cp.kubectl("delete", "-n", namespace, "deployment", "gc", "--wait=false")
    cp.wait_for(
        lambda: (
            not get_json(cp, f"/apis/apps/v1/namespaces/{namespace}/replicasets?labelSelector=app=gc")[
                "items"
            ]
            and not pods(cp, namespace, "app=gc")
        ),
        what="ReplicaSet and pods garbage-collected",
    )

    # Plain ownerReferences between arbitrary objects are honoured too.
    owner = cp.http.post(
        f"/api/v1/namespaces/{namespace}/configmaps", json={"metadata": {"name": "owner"}}
    ).json()
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner["metadata"]["uid"]}
    child = {"metadata": {"name": "child", "ownerReferences": [ref]}}
    assert cp.http.post(f"/api/v1/namespaces/{namespace}/configmaps", json=child).status_code == 201
    cp.kubectl("delete", "-n", namespace, "configmap", "owner")
    cp.wait_for(
        lambda: cp.http.get(f"/api/v1/namespaces/{namespace}/configmaps/child").status_code == 404,
        what="owned ConfigMap deleted",
    )


def test_daemonset_puts_one_running_pod_on_each_selected_node(
    control_plane: ControlPlane, namespace: str
) -> None:
    cp = control_plane
    pool = f"p{uuid.uuid4().hex[:6]}"
    nodes = set(cp.add_gpu_nodes(3, labels={"pool": pool}))
    ds = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "agent"},
        "spec": {
            "selector": {"matchLabels": {"app": "agent"}},
            "template": {
                "metadata": {"labels": {"app": "agent"}},
                "spec": {
                    "nodeSelector": {"pool": pool},
                    "containers": [{"name": "a", "image": "x.invalid/a:1"}],
                },
            },
        },
    }
    cp.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(ds))
    cp.wait_for(
        lambda: (
            get_json(cp, f"/apis/apps/v1/namespaces/{namespace}/daemonsets/agent")["status"].get(
                "numberReady"
            )
            == 3
        ),
        what="3 ready DaemonSet pods",
    )
    assert {p["spec"]["nodeName"] for p in pods(cp, namespace, "app=agent")} == nodes

    gone = sorted(nodes)[0]
    cp.remove_node(gone)
    cp.wait_for(lambda: cp.http.get(f"/api/v1/nodes/{gone}").status_code == 404, what="node deleted")
    cp.wait_for(
        lambda: {p["spec"]["nodeName"] for p in pods(cp, namespace, "app=agent")} == nodes - {gone},
        what="DaemonSet pods only on the remaining nodes",
        timeout_s=90,  # a pod the sweep missed is the pod collector's: 40 s quarantine + 20 s period
    )


def test_rbac_denies_an_unprivileged_service_account(control_plane: ControlPlane, namespace: str) -> None:
    cp = control_plane
    sa = cp.service_account_kubeconfig(namespace, "nobody")
    denied = cp.kubectl("get", "pods", "-n", namespace, kubeconfig=sa, check=False)
    assert denied.returncode != 0
    assert "forbidden" in denied.stderr.lower()
    assert f"system:serviceaccount:{namespace}:nobody" in denied.stderr

    cp.kubectl("create", "role", "pod-reader", "-n", namespace, "--verb=list,get", "--resource=pods")
    cp.kubectl(
        "create",
        "rolebinding",
        "nobody-reads",
        "-n",
        namespace,
        "--role=pod-reader",
        f"--serviceaccount={namespace}:nobody",
    )
    assert cp.kubectl("get", "pods", "-n", namespace, kubeconfig=sa).returncode == 0
    assert (
        cp.kubectl(
            "auth", "can-i", "delete", "pods", "-n", namespace, kubeconfig=sa, check=False
        ).stdout.strip()
        == "no"
    )
