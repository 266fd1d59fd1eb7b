"""The real node under the tests (keepwarm_testing.node), on its own: what the e2e tests rely on.

One control plane with one real node (root only): a pod from the Dockerfile's runtime image runs as
the image's user and reaches the API server through the `kubernetes` Service (kube-proxy), the node's
kubelet answers logs and exec; the faults a test must be able to name (an image that fails to pull,
an entrypoint that does not exist, a crash loop) are named with the pod's events and logs; a kubelet
that refuses this machine's cgroups says so in one line; and the node leaves nothing on the machine.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from keepwarm_testing.controlplane.cluster import ControlPlane
from keepwarm_testing.e2e import RUNTIME_IMAGE, real_cluster
from keepwarm_testing.node.kubelet import Kubelet, KubeletError, remove_cgroup_root
from tests.running_pods import ON_REAL_NODES

pytestmark = ON_REAL_NODES
NS = "node-test"


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[SimpleNamespace]:
    with real_cluster(lambda: request.session.testsfailed > 0) as cp:
        (node,) = cp.add_gpu_nodes(1)
        cp.kubectl("create", "namespace", NS)
        yield SimpleNamespace(cp=cp, node=node)


def pod(name: str, image: str, command: list[str], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"containers": [{"name": "main", "image": image, "command": command}], **spec},
    }


def get(cp: ControlPlane, name: str) -> dict[str, Any]:
    return cp.http.get(f"/api/v1/namespaces/{NS}/pods/{name}").json()


def waiting_reason(cp: ControlPlane, name: str) -> str:
    statuses = get(cp, name).get("status", {}).get("containerStatuses", [])
    return statuses[0].get("state", {}).get("waiting", {}).get("reason", "") if statuses else ""


# A client in the pod: the Service account token, the `kubernetes` Service's address from the kubelet's
# environment, the cluster's CA; it lists the pod's own namespace's pods as that account.
IN_CLUSTER = f"""
import json, os, ssl, urllib.request
sa = "/var/run/secrets/kubernetes.io/serviceaccount"
host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
url = "https://" + host + ":" + port + "/api/v1/namespaces/{NS}/pods/in-cluster"
token = open(sa + "/token").read()
req = urllib.request.Request(url, headers={{"Authorization": "Bearer " + token}})
pod = json.load(urllib.request.urlopen(req, context=ssl.create_default_context(cafile=sa + "/ca.crt")))
print("uid", os.getuid(), "host", host, "pod", pod["metadata"]["name"])
"""


def test_a_runtime_image_pod_reaches_the_api_server_through_the_kubernetes_service(
    cluster: SimpleNamespace,
) -> None:
    cp = cluster.cp
    cp.http.post(
        f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/rolebindings",
        json={
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": "view"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "view"},
            "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": NS}],
        },
    ).raise_for_status()
    body = pod("in-cluster", RUNTIME_IMAGE, ["python3", "-c", IN_CLUSTER], restartPolicy="Never")
    cp.http.post(f"/api/v1/namespaces/{NS}/pods", json=body).raise_for_status()
    cp.wait_for(lambda: get(cp, "in-cluster")["status"].get("phase") == "Succeeded", timeout_s=180,
                what="the in-cluster client pod done")  # fmt: skip
    out = cp.kubectl("logs", "-n", NS, "in-cluster").stdout.split()
    assert out == ["uid", "10001", "host", "10.0.0.1", "pod", "in-cluster"]  # the image's USER; the Service


def test_exec_reaches_a_running_container_through_the_kubelet(cluster: SimpleNamespace) -> None:
    cp = cluster.cp
    body = pod("sleeper", RUNTIME_IMAGE, ["python3", "-c", "import time; time.sleep(3600)"])
    cp.http.post(f"/api/v1/namespaces/{NS}/pods", json=body).raise_for_status()
    cp.wait_for(lambda: get(cp, "sleeper")["status"].get("phase") == "Running", timeout_s=180, what="sleeper")
    out = cp.kubectl("exec", "-n", NS, "sleeper", "--", "keepwarm", "--help").stdout
    assert "serve" in out
    assert cp.nodes is not None and cp.nodes.container_pid(get(cp, "sleeper")) > 1


@pytest.mark.parametrize(
    ("name", "image", "command", "reason", "named"),
    [
        ("no-image", "ghcr.io/keepwarm/no-such-image:0", ["true"], ("ErrImagePull", "ImagePullBackOff"),
         "not found"),
        ("no-entrypoint", RUNTIME_IMAGE, ["/no/such/binary"], ("RunContainerError", "CrashLoopBackOff"),
         "/no/such/binary"),
        ("crash-loop", RUNTIME_IMAGE, ["python3", "-c", "print('about to fail'); raise SystemExit(3)"],
         ("CrashLoopBackOff",), "about to fail"),
    ],
)  # fmt: skip
def test_a_pod_that_cannot_run_is_named_with_its_events_and_logs(
    cluster: SimpleNamespace, name: str, image: str, command: list[str], reason: tuple[str, ...], named: str
) -> None:
    cp = cluster.cp
    cp.http.post(f"/api/v1/namespaces/{NS}/pods", json=pod(name, image, command)).raise_for_status()
    cp.wait_for(lambda: waiting_reason(cp, name) in reason, timeout_s=180, what=f"{name} failing as {reason}")
    with pytest.raises(TimeoutError) as failed:
        cp.wait_for(lambda: False, timeout_s=0.1, what="a pod that never gets Ready")
    text = str(failed.value)
    block = text[text.index(f"pod {NS}/{name} ") :].split("\npod ")[0]  # this pod's part of the explanation
    assert waiting_reason(cp, name) in block or "Error" in block
    assert named in block, block
    assert "event " in block
    cp.http.delete(f"/api/v1/namespaces/{NS}/pods/{name}?gracePeriodSeconds=0")


def test_a_kubelet_refusing_the_machine_says_why_in_one_line(
    cluster: SimpleNamespace, tmp_path: Path
) -> None:
    """With the kubelet's default failCgroupV1 on this cgroup v1 machine it exits; the harness names
    the cause and the remedy in one line (on a cgroup v2 machine this kubelet would start: skipped)."""
    if Path("/sys/fs/cgroup/cgroup.controllers").exists():
        pytest.skip("this machine runs cgroup v2: the kubelet accepts it")
    cp = cluster.cp
    assert cp.nodes is not None
    node = next(iter(cp.nodes.nodes.values()))
    assert node.containerd is not None
    kubelet = Kubelet(
        "refused", tmp_path, cp.bin_dir, cp.server, cp.pki, node.address, "10.1.2.0/24",
        node.containerd.endpoint, labels={}, cluster_dns=cp.nodes.bridge.gateway, fail_cgroup_v1=True,
    )  # fmt: skip
    try:
        with pytest.raises(KubeletError) as refused:
            kubelet.start()
            kubelet.proc.wait(timeout=60)
            kubelet.check()
    finally:
        kubelet.stop()
        remove_cgroup_root(kubelet.cgroup_root)
    message = str(refused.value)
    assert "\n" not in message and "cgroup v1" in message and "failCgroupV1" in message
