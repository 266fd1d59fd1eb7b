"""The test cluster's add-ons on real nodes (keepwarm_testing/node/addons.py): cluster DNS and the
LeaderWorkerSet API, as a user's cluster has them.

Two real nodes; a pod resolves the `kubernetes` Service by name through CoreDNS; a LeaderWorkerSet of
size 2 is turned into its leader and worker pods by the real LWS controller, its pod webhook gives them
their LWS_* variables, the worker resolves LWS_LEADER_ADDRESS (the leader's name under the headless
Service LWS makes) to the leader pod's address and talks TCP to the leader on the other node.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from keepwarm_testing.controlplane.cluster import ControlPlane
from keepwarm_testing.e2e import RUNTIME_IMAGE, real_cluster
from keepwarm_testing.node.addons import LWS_GROUP, LWS_NAME_LABEL
from tests.running_pods import ON_REAL_NODES

pytestmark = ON_REAL_NODES
NS = "lws-test"
LWS = "pair"
PORT = 7777


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[SimpleNamespace]:
    with real_cluster(lambda: request.session.testsfailed > 0) as cp:
        nodes = cp.add_gpu_nodes(2)
        lws = cp.install_lws()
        assert cp.install_lws() is lws  # idempotent: the same controller
        cp.kubectl("create", "namespace", NS)
        yield SimpleNamespace(cp=cp, nodes=nodes)


def pod_of(cp: ControlPlane, name: str) -> dict[str, Any]:
    return cp.http.get(f"/api/v1/namespaces/{NS}/pods/{name}").json()


def log_of(cp: ControlPlane, name: str) -> str:
    return cp.kubectl("logs", "-n", NS, name, check=False).stdout


RESOLVE_SERVICE = """
import socket
print(open("/etc/resolv.conf").read())
for name in ("kubernetes.default.svc.cluster.local", "kubernetes.default"):  # the second by search path
    print("resolved", name, socket.gethostbyname(name))  # over UDP
# The same question over TCP (what a truncated answer falls back to), by hand: an A query, one answer.
labels = b"".join(bytes([len(p)]) + p.encode() for p in "kubernetes.default.svc.cluster.local".split("."))
query = bytes.fromhex("123401000001000000000000") + labels + bytes.fromhex("0000010001")
server = next(line.split()[1] for line in open("/etc/resolv.conf") if line.startswith("nameserver"))
conn = socket.create_connection((server, 53), timeout=10)
conn.sendall(len(query).to_bytes(2, "big") + query)
answer = conn.recv(4096)[2:]
print("tcp", socket.inet_ntoa(answer[-4:]), "answers", int.from_bytes(answer[6:8], "big"))
"""


def test_a_service_name_resolves_through_the_cluster_dns(cluster: SimpleNamespace) -> None:
    cp = cluster.cp
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "resolver", "namespace": NS},
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {"name": "main", "image": RUNTIME_IMAGE, "command": ["python3", "-c", RESOLVE_SERVICE]}
            ],
        },
    }
    cp.http.post(f"/api/v1/namespaces/{NS}/pods", json=body).raise_for_status()
    phase = cp.wait_for(
        lambda: pod_of(cp, "resolver").get("status", {}).get("phase") in ("Succeeded", "Failed")
        and pod_of(cp, "resolver")["status"]["phase"],
        timeout_s=180, what="the resolver pod done",
    )  # fmt: skip
    out = log_of(cp, "resolver")
    assert phase == "Succeeded", f"{out}\n{cp.explain_pods()}"
    service_ip = cp.http.get("/api/v1/namespaces/default/services/kubernetes").json()["spec"]["clusterIP"]
    assert cp.nodes is not None
    assert f"nameserver {cp.nodes.bridge.gateway}" in out  # ClusterFirst: CoreDNS on the bridge
    assert f"search {NS}.svc.cluster.local svc.cluster.local cluster.local" in out
    resolved = [line.split() for line in out.splitlines() if line.startswith("resolved ")]
    names = ("kubernetes.default.svc.cluster.local", "kubernetes.default")
    assert resolved == [["resolved", name, service_ip] for name in names], out
    assert f"tcp {service_ip} answers 1" in out


# The leader serves one line to each worker that connects, naming itself; it logs who came.
LEADER = f"""
import os, socket
server = socket.create_server(("0.0.0.0", {PORT}))
print("listening", {{k: v for k, v in os.environ.items() if k.startswith("LWS_")}}, flush=True)
while True:
    conn, peer = server.accept()
    print("worker", conn.recv(100).decode(), "from", peer[0], flush=True)
    conn.sendall(b"leader " + socket.gethostname().encode())
    conn.close()
"""
# The worker resolves the leader's address by DNS (until its record exists), connects, says its index.
WORKER = f"""
import os, socket, time
address = os.environ["LWS_LEADER_ADDRESS"]
deadline = time.monotonic() + 120
while True:
    try:
        ip = socket.gethostbyname(address)
        conn = socket.create_connection((ip, {PORT}), timeout=5)
        break
    except OSError as exc:
        if time.monotonic() > deadline:
            raise
        print("retrying", address, repr(exc), flush=True)
        time.sleep(1)
conn.sendall(os.environ["LWS_WORKER_INDEX"].encode())
print("resolved", address, ip, "reply", conn.recv(100).decode(), flush=True)
time.sleep(36000)
"""


def pod_template(script: str) -> dict[str, Any]:
    """Leader and worker on different nodes (anti-affinity on the LWS's name label)."""
    apart = {
        "labelSelector": {"matchExpressions": [{"key": LWS_NAME_LABEL, "operator": "In", "values": [LWS]}]},
        "topologyKey": "kubernetes.io/hostname",
    }
    return {
        "spec": {
            "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [apart]}},
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "main", "image": RUNTIME_IMAGE, "command": ["python3", "-c", script]}],
        }
    }


def test_a_leaderworkerset_worker_finds_its_leader_by_dns_on_another_node(cluster: SimpleNamespace) -> None:
    cp = cluster.cp
    lws = {
        "apiVersion": f"{LWS_GROUP}/v1",
        "kind": "LeaderWorkerSet",
        "metadata": {"name": LWS, "namespace": NS},
        "spec": {
            "replicas": 1,
            "leaderWorkerTemplate": {
                "size": 2,
                "leaderTemplate": pod_template(LEADER),
                "workerTemplate": pod_template(WORKER),
            },
        },
    }
    created = cp.http.post(f"/apis/{LWS_GROUP}/v1/namespaces/{NS}/leaderworkersets", json=lws)
    assert created.status_code == 201, created.text
    # Defaulted by the LWS webhook (the CRD's schema has no default for it).
    assert created.json()["spec"]["networkConfig"] == {"subdomainPolicy": "Shared"}
    leader, worker = f"{LWS}-0", f"{LWS}-0-1"

    def replied() -> bool:
        return "reply leader" in log_of(cp, worker)

    try:
        cp.wait_for(replied, timeout_s=300, what="the worker's reply from its leader")
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\nworker log:\n{log_of(cp, worker)}\n{cp.explain_pods()}") from None

    def both_with_addresses() -> dict[str, dict[str, Any]] | None:
        # The kubelet reports a pod's address in its own time: a container may log before it does.
        pods = {name: pod_of(cp, name) for name in (leader, worker)}
        return pods if all(p["status"].get("podIP") for p in pods.values()) else None

    pods = cp.wait_for(both_with_addresses, timeout_s=120, what="both pods' addresses in their status")
    # Made by the LWS controller: the leader by the LWS's StatefulSet, the worker by the group's.
    owners = {name: pod["metadata"]["ownerReferences"][0] for name, pod in pods.items()}
    assert (owners[leader]["kind"], owners[leader]["name"]) == ("StatefulSet", LWS)
    assert (owners[worker]["kind"], owners[worker]["name"]) == ("StatefulSet", leader)
    sts = cp.http.get(f"/apis/apps/v1/namespaces/{NS}/statefulsets/{LWS}").json()
    assert sts["metadata"]["ownerReferences"][0]["kind"] == "LeaderWorkerSet"
    # The pod webhook's labels and variables.
    for index, name in enumerate((leader, worker)):
        labels = pods[name]["metadata"]["labels"]
        assert labels[LWS_NAME_LABEL] == LWS
        assert labels["leaderworkerset.sigs.k8s.io/group-index"] == "0"
        assert labels["leaderworkerset.sigs.k8s.io/worker-index"] == str(index)
        env = {e["name"]: e.get("value") for e in pods[name]["spec"]["containers"][0]["env"]}
        assert env["LWS_LEADER_ADDRESS"] == f"{leader}.{LWS}.{NS}"
        assert env["LWS_GROUP_SIZE"] == "2"
        assert env["LWS_WORKER_INDEX"] == str(index)
    # Two nodes, and the name resolved to the leader pod's own address.
    assert pods[leader]["spec"]["nodeName"] != pods[worker]["spec"]["nodeName"]
    leader_ip, worker_ip = (pods[name]["status"]["podIP"] for name in (leader, worker))
    assert f"resolved {leader}.{LWS}.{NS} {leader_ip} reply leader {leader}" in log_of(cp, worker)
    assert f"worker 1 from {worker_ip}" in log_of(cp, leader)


def test_pods_outside_a_leaderworkerset_never_reach_its_webhooks(cluster: SimpleNamespace) -> None:
    """The pod webhooks select pods by the LWS name label, so keepwarm's own pods do not depend on the
    LWS controller running: with it stopped, a plain pod is still admitted, an LWS pod is refused."""
    cp = cluster.cp
    assert cp.nodes is not None and cp.nodes.lws is not None
    hooks = cp.http.get(
        "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/lws-mutating-webhook-configuration"
    ).json()["webhooks"]
    pod_hook = next(h for h in hooks if h["name"] == "mpod.kb.io")
    assert pod_hook["objectSelector"]["matchExpressions"][0]["key"] == LWS_NAME_LABEL
    cp.nodes.lws.stop()
    try:
        plain = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "plain"},
                 "spec": {"containers": [{"name": "main", "image": RUNTIME_IMAGE}]}}  # fmt: skip
        url = f"/api/v1/namespaces/{NS}/pods"
        assert cp.http.post(url, params={"dryRun": "All"}, json=plain).status_code == 201
        labelled = {**plain, "metadata": {"name": "labelled", "labels": {LWS_NAME_LABEL: "x"}}}
        refused = cp.http.post(url, params={"dryRun": "All"}, json=labelled)
        assert refused.status_code == 500 and "mpod.kb.io" in refused.text, refused.text
    finally:
        cp.install_lws()  # started again: other tests of this module may follow
