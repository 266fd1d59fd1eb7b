"""A model split over ranks on real pods: one pod of two ranks, each attaching its shard from the node
cache, then a group of two pods run as a LeaderWorkerSet (sigs.k8s.io/lws), answering the openai client
through its leader and restarted as a whole when one of its pods dies.

One control plane with two real nodes (keepwarm_testing.node), cluster DNS (CoreDNS: the worker pod
finds its leader by the name LWS gives it) and the LeaderWorkerSet controller, CRDs and webhooks built
from source (`cp.install_lws()`); `helm install` of the chart; a host-tier WeightCache on the first node
holding the model as 2 tensor-parallel shards (its agent's `keepwarm cache serve --tensor-parallel-size
2`). The pods run on CPU: each rank is a process, the ranks meet over gloo (docs/parallel.md).
"""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace
from typing import Any

import pytest

from keepwarm_api import lws
from keepwarm_testing.e2e import (
    answer,
    apply,
    cpu_inference_deployment,
    create_namespace,
    host_weightcache,
    install_chart,
    is_ready,
    lists_resident,
    metric,
    pods,
    ready_pods,
    runtime_selector,
    weightcache_nodes,
)
from keepwarm_testing.operator import GROUP_PATH, condition, get
from tests.running_pods import ON_REAL_NODES

pytestmark = ON_REAL_NODES
WC, APPS = "shards", "parallel-apps"
HOSTNAME = "kubernetes.io/hostname"


@pytest.fixture(scope="module")
def cluster(e2e_cluster: SimpleNamespace) -> SimpleNamespace:
    """The module's cluster with a second node, LWS installed, the chart, and the shards resident."""
    cp = e2e_cluster.cp
    cp.install_lws()
    cp.add_gpu_nodes(1)
    install_chart(cp)
    cache = host_weightcache(WC)
    cache["spec"]["models"][0]["parallelism"] = {"tensor": 2}
    cache["spec"]["nodeSelector"] = {HOSTNAME: e2e_cluster.node}  # one agent: the nodes share a host
    apply(cp, cache)

    def resident() -> bool:
        found = weightcache_nodes(cp, WC)
        return len(found) == 1 and lists_resident(found[0])

    cp.wait_for(resident, timeout_s=300, what="the two shards resident on the first node")
    create_namespace(cp, APPS)
    return e2e_cluster


def _logs(cp, pod: dict[str, Any]) -> str:
    return cp.kubectl("logs", "-n", APPS, pod["metadata"]["name"]).stdout


def _idep(name: str, parallelism: dict[str, int], node: str | None = None) -> dict[str, Any]:
    dep = cpu_inference_deployment(name, APPS, WC, replicas=1)
    dep["spec"]["parallelism"] = parallelism
    if node is not None:
        dep["spec"]["pod"] = {"nodeSelector": {HOSTNAME: node}}
    return dep


def test_a_pod_of_two_ranks_attaches_each_shard_from_the_node_cache(cluster: SimpleNamespace) -> None:
    cp = cluster.cp
    apply(cp, _idep("split", {"tensor": 2}, node=cluster.node))
    (pod,) = cp.wait_for(
        lambda: ready_pods(cp, APPS, runtime_selector("split"), 1), timeout_s=300, what="the 2-rank pod"
    )
    cluster.answer = answer(pod)
    assert cluster.answer
    logs = _logs(cp, pod)
    for rank in (0, 1):  # each rank's own line (engine/loader.py)
        assert f"rank {rank} of 2: weights from cache" in logs, logs[-3000:]
    assert set(metric(pod, "keepwarm_weight_load_seconds")) == {"cache"}
    idep = get(cp, f"{GROUP_PATH}/namespaces/{APPS}/inferencedeployments/split")
    assert condition(idep, "CacheWarm")["reason"] == "ModelResident", idep["status"]
    cp.kubectl("delete", "-n", APPS, "inferencedeployment/split", "--wait=true")


def _group(cp) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(leader, worker) of the group once both are Ready."""
    ready = [p for p in pods(cp, APPS, runtime_selector("spread")) if is_ready(p)]
    by_index = {p["metadata"]["labels"].get(lws.WORKER_INDEX_LABEL): p for p in ready}
    return (by_index["0"], by_index["1"]) if set(by_index) == {"0", "1"} and len(ready) == 2 else None


def test_a_group_over_two_pods_answers_through_its_leader(cluster: SimpleNamespace) -> None:
    cp = cluster.cp
    apply(cp, _idep("spread", {"tensor": 2, "nodes": 2}))
    leader, worker = cp.wait_for(lambda: _group(cp), timeout_s=420, what="the leader and worker Ready")
    group = get(cp, f"/apis/{lws.API_VERSION}/namespaces/{APPS}/{lws.PLURAL}/spread-group")
    assert group is not None and group["metadata"]["ownerReferences"][0]["kind"] == "InferenceDeployment"
    # the same split, ranks in two pods: the same greedy answer as the one pod of two ranks
    assert answer(leader) == cluster.answer
    worker_logs = _logs(cp, worker)
    assert "supervising ranks 1..1 of 2 (node 1 of 2, no API)" in worker_logs, worker_logs[-3000:]
    assert "joined the tensor-parallel group as rank 1 of 2 (gloo)" in worker_logs
    env = {e["name"]: e.get("value") for e in worker["spec"]["containers"][0]["env"]}
    assert env[lws.LEADER_ADDRESS_ENV] == f"spread-group-0.spread-group.{APPS}"  # found by cluster DNS
    # the Service sends requests to the leader alone: the worker has no API
    slices = get(cp, f"/apis/discovery.k8s.io/v1/namespaces/{APPS}/endpointslices?labelSelector="
                 "kubernetes.io/service-name=spread")  # fmt: skip
    addresses = {a for s in slices["items"] for e in s.get("endpoints") or [] for a in e["addresses"]}
    assert addresses == {leader["status"]["podIP"]}

    def available() -> bool:
        idep = get(cp, f"{GROUP_PATH}/namespaces/{APPS}/inferencedeployments/spread")
        return condition(idep, "Available").get("status") == "True"

    cp.wait_for(available, timeout_s=120, what="the InferenceDeployment Available from the group's status")
    cluster.group = (leader, worker)


def test_a_dead_worker_restarts_the_whole_group(cluster: SimpleNamespace) -> None:
    cp = cluster.cp
    leader, worker = cluster.group
    assert cp.nodes is not None
    os.kill(cp.nodes.container_pid(worker), signal.SIGKILL)  # the worker pod's supervising parent

    def recreated() -> tuple[dict[str, Any], dict[str, Any]] | None:
        group = _group(cp)
        if group is None:
            return None
        uids = {p["metadata"]["uid"] for p in group}
        return group if not uids & {leader["metadata"]["uid"], worker["metadata"]["uid"]} else None

    new_leader, _ = cp.wait_for(recreated, timeout_s=420, what="the group recreated, leader and worker")
    assert answer(new_leader) == cluster.answer
