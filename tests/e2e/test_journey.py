"""The user's journey on real pods: helm install to first token, then restarts as a user causes them.

One control plane with a real node (root only: the kubelet on containerd and runc, the images built from
the Dockerfile; keepwarm_testing.node): `helm install` of charts/keepwarm (the operator runs as the
chart's Deployment pod, as its ServiceAccount); a host-tier WeightCache with a model under
modelDirectory (and a LoRA adapter of it) and one from the Hub (keepwarm_testing.hub on the pod bridge,
named as the cache's Hub mirror; the agent DaemonSet pod runs `keepwarm cache serve`); an
InferenceDeployment of 2 replicas serving the model and that cached adapter (pods run `keepwarm serve`
as rendered), whose adapter list then changes with no rollout. Process snapshots are on (the cache's
spec.snapshots, the deployment's spec.startup.mode Snapshot): the first pods import and the agent takes
one snapshot, and every pod a delete, a crash or a scale-up brings is restored from it
(docs/snapshots.md). The official `openai` client talks to
each pod IP; the agent pod is restarted and then a spec change rolls the pods while client threads send
requests all along. The steps share state and run in order.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import helm_python as helm
import httpx
import openai
import pytest

from keepwarm_api.paths import hf_snapshot_dir
from keepwarm_api.weightcache import WeightCacheSpec
from keepwarm_runtime.modelgen import make_model
from keepwarm_testing.controlplane.cluster import ControlPlane
from keepwarm_testing.e2e import (
    MODEL,
    MODEL_DIR,
    PROMPT,
    agent_metrics,
    answer,
    apply,
    children,
    client,
    cpu_inference_deployment,
    create_namespace,
    host_weightcache,
    install_chart,
    is_ready,
    lists_resident,
    metric,
    pods,
    ready_pods,
    resident_node,
    sample_sum,
    serving_chain,
)
from keepwarm_testing.hub import LocalHub
from keepwarm_testing.operator import GROUP_PATH, NAMESPACE, RELEASE, condition, get, items
from tests.running_pods import ON_REAL_NODES

pytestmark = ON_REAL_NODES
WC, IDEP, APPS = "journey", "chat", "journey-apps"
HUB_MODEL, HUB_REPO = "tiny-hub", "org/tiny-hub"  # a second model, from the (loopback) Hub
ADAPTER = "terse"  # a LoRA adapter of MODEL the WeightCache keeps and the InferenceDeployment serves
ADAPTER_DIR = f"/var/lib/models/adapters/{ADAPTER}"  # on the node, under the default modelDirectory
LATER = "brief"  # a second adapter the WeightCache keeps, added to the pods' list while they serve
LATER_DIR = f"/var/lib/models/adapters/{LATER}"


@pytest.fixture(scope="module")
def journey(e2e_cluster: SimpleNamespace) -> SimpleNamespace:
    return e2e_cluster


@pytest.fixture(scope="module")
def hub(journey: SimpleNamespace, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    """The loopback Hub on the pod bridge's address (pods reach the host there), holding HUB_REPO."""
    assert journey.cp.nodes is not None
    work = tmp_path_factory.mktemp("hub")
    served = LocalHub(work / "hub", host=journey.cp.nodes.bridge.gateway)
    (work / "hub").mkdir()
    sha = served.add_repo(HUB_REPO, make_model(work / "model", params="1M", dtype="bfloat16", seed=1))
    served.start()
    yield SimpleNamespace(hub=served, sha=sha)
    served.stop()


RUNTIME = f"app.kubernetes.io/name=keepwarm-runtime,app.kubernetes.io/instance={IDEP}"
AGENTS = f"app.kubernetes.io/name=keepwarm-agent,app.kubernetes.io/instance={WC}"


def test_helm_install_runs_the_operator_as_its_pod(journey: SimpleNamespace) -> None:
    operator = install_chart(journey.cp)
    assert operator["spec"]["serviceAccountName"] == f"{RELEASE}-keepwarm"


def test_weightcache_agent_pod_makes_the_node_ready(
    journey: SimpleNamespace, hub: SimpleNamespace, adapter_dir: Path
) -> None:
    """One model under modelDirectory with a LoRA adapter, one from the Hub: the agent pod downloads
    it through the Hub mirror the WeightCache names (spec.agent.huggingFaceEndpoint)."""
    cp = journey.cp
    cache = host_weightcache(WC, huggingFaceEndpoint=hub.hub.endpoint)
    cache["spec"]["models"][0]["adapters"] = [
        {"name": ADAPTER, "source": {"path": ADAPTER_DIR}},
        {"name": LATER, "source": {"path": LATER_DIR}},
    ]
    hub_source = {"huggingFace": {"repo": HUB_REPO, "revision": "main"}}
    cache["spec"]["models"].append({"name": HUB_MODEL, "source": hub_source})
    cache["spec"]["snapshots"] = {"enabled": True}
    apply(cp, cache)

    def adapter_resident(wcn: dict[str, Any]) -> bool:
        adapters = (wcn.get("status") or {}).get("adapters", [])
        return {a["name"] for a in adapters if a["state"] == "Resident"} == {ADAPTER, LATER}

    wcn = cp.wait_for(
        lambda: (w := resident_node(cp, WC)) and lists_resident(w, HUB_MODEL) and adapter_resident(w) and w,
        timeout_s=240,
        what="WeightCacheNode Ready with both models and the adapter resident",
    )
    # The operator's aggregate says so too (WeightCache status.adapters).
    cp.wait_for(
        lambda: (
            [
                (a["model"], a["name"], a["residentNodes"])
                for a in get(cp, f"{GROUP_PATH}/weightcaches/{WC}").get("status", {}).get("adapters", [])
            ]
            == sorted([(MODEL, ADAPTER, 1), (MODEL, LATER, 1)])  # by model, then name
        ),
        timeout_s=120,
        what="WeightCache status.adapters counting the node",
    )
    assert wcn["spec"]["nodeName"] == journey.node
    assert hub.hub.requests_for(HUB_REPO), "the agent did not download through the WeightCache's mirror"
    node_downloads = WeightCacheSpec.model_fields["download_directory"].default  # a node path
    snapshot = journey.root / hf_snapshot_dir(HUB_REPO, hub.sha, node_downloads).lstrip("/")
    assert (snapshot / "config.json").is_file()  # in the node's download directory
    cp.wait_for(lambda: ready_pods(cp, NAMESPACE, AGENTS, 1), timeout_s=120, what="the agent pod Ready")


@pytest.fixture(scope="module")
def adapter_dir(journey: SimpleNamespace) -> Path:
    """A PEFT adapter of the journey's model on the node, under the WeightCache's modelDirectory
    (ADAPTER_DIR there), readable by the runtime's uid."""
    from tests.lora_adapters import make_adapter

    base = journey.root / MODEL_DIR.lstrip("/")
    out = make_adapter(
        base, journey.root / ADAPTER_DIR.lstrip("/"), 3, r=8, target_modules=["q_proj", "v_proj"]
    )
    later = make_adapter(base, journey.root / LATER_DIR.lstrip("/"), 4, r=4, target_modules=["o_proj"])
    for path in [out, *out.rglob("*"), later, *later.rglob("*")]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    return out


def test_inference_pods_answer_from_the_node_cache(journey: SimpleNamespace) -> None:
    """2 replicas attach the model from the node cache; spec.lora names the WeightCache's adapter
    (source.cached), which the pods mount and attach from the node cache too (the CRD's fields,
    rendered to `keepwarm serve`'s flags, answered through the openai client)."""
    cp = journey.cp
    create_namespace(cp, APPS, snapshot_startup=True)
    dep = cpu_inference_deployment(IDEP, APPS, WC, replicas=2)
    adapters = [{"name": ADAPTER, "source": {"cached": ADAPTER}}]  # the WeightCache's adapter
    dep["spec"]["lora"] = {"maxLoras": 2, "maxLoraRank": 8, "adapters": adapters}
    dep["spec"]["startup"] = {"mode": "Snapshot"}
    apply(cp, dep)
    ready = cp.wait_for(lambda: ready_pods(cp, APPS, RUNTIME, 2), timeout_s=300, what="2 runtime pods Ready")
    # Nothing to restore yet: both imported, and the agent took one snapshot for them (single flight).
    assert all(set(metric(p, "keepwarm_startup_source_total")) == {"imports"} for p in ready)
    cp.wait_for(lambda: len(snapshots(cp)) == 1, timeout_s=300, what="the node's snapshot taken")
    answers = {answer(p) for p in ready}
    assert len(answers) == 1 and answers != {""}
    journey.answer = answers.pop()
    for pod in ready:
        served = {m.id: m for m in client(pod).models.list()}
        assert served[ADAPTER].model_extra["parent"] == MODEL, served
        out = client(pod).chat.completions.create(model=ADAPTER, messages=PROMPT, max_tokens=8, temperature=0)
        assert out.model == ADAPTER and out.choices[0].message.content not in ("", journey.answer)
    for pod in ready:
        loads = metric(pod, "keepwarm_weight_load_seconds")
        assert set(loads) == {"cache"}, loads  # attached from the node cache, nothing from disk
        adapter_loads = metric(pod, "keepwarm_lora_load_seconds_count")
        assert adapter_loads == {"cache": 1.0}, adapter_loads  # the adapter too
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert env["KEEPWARM_CACHE_MODE"] == "zero_copy"


def test_a_new_adapter_list_reaches_the_serving_pods_without_a_rollout(journey: SimpleNamespace) -> None:
    """spec.lora.adapters gains the WeightCache's second adapter and then loses the first: the same two
    pods (same uids, no restart, the Deployment's generation unchanged) serve the new list within the
    kubelet's ConfigMap sync, the added adapter attached from the node cache, the removed one a 404."""
    cp = journey.cp
    before = ready_pods(cp, APPS, RUNTIME, 2)
    generation = get(cp, f"/apis/apps/v1/namespaces/{APPS}/deployments/{IDEP}")["metadata"]["generation"]

    def set_adapters(*names: str) -> None:
        adapters = [{"name": n, "source": {"cached": n}} for n in names]
        patch = {"spec": {"lora": {"adapters": adapters}}}
        cp.kubectl(
            "patch", "-n", APPS, f"inferencedeployment/{IDEP}", "--type=merge", "-p", json.dumps(patch)
        )

    def serving(want: set[str]) -> bool:
        return all({m.id for m in client(p).models.list()} - {MODEL} == want for p in before)

    set_adapters(ADAPTER, LATER)
    cp.wait_for(lambda: serving({ADAPTER, LATER}), timeout_s=120, what="both pods serving the new adapter")
    for pod in before:
        out = client(pod).chat.completions.create(model=LATER, messages=PROMPT, max_tokens=8, temperature=0)
        assert out.model == LATER and out.choices[0].message.content not in ("", journey.answer)
        assert metric(pod, "keepwarm_lora_load_seconds_count") == {"cache": 2.0}  # from the node cache
    set_adapters(LATER)
    cp.wait_for(lambda: serving({LATER}), timeout_s=120, what="both pods without the removed adapter")
    for pod in before:
        with pytest.raises(openai.NotFoundError):
            client(pod).chat.completions.create(model=ADAPTER, messages=PROMPT, max_tokens=2)
    after = ready_pods(cp, APPS, RUNTIME, 2)
    assert {p["metadata"]["uid"] for p in after} == {p["metadata"]["uid"] for p in before}
    assert all(p["status"]["containerStatuses"][0]["restartCount"] == 0 for p in after)
    assert (
        get(cp, f"/apis/apps/v1/namespaces/{APPS}/deployments/{IDEP}")["metadata"]["generation"] == generation
    )


def test_deleted_pod_is_replaced_and_answers_identically(journey: SimpleNamespace) -> None:
    cp = journey.cp
    before = ready_pods(cp, APPS, RUNTIME, 2)
    victim = before[0]
    cp.kubectl("delete", "pod", "-n", APPS, victim["metadata"]["name"], "--wait=true", timeout=120)
    fresh = cp.wait_for(
        lambda: (
            (r := ready_pods(cp, APPS, RUNTIME, 2))
            and victim["metadata"]["uid"] not in {p["metadata"]["uid"] for p in r}
            and r
        ),
        timeout_s=300,
        what="a replacement pod Ready",
    )
    for pod in fresh:
        assert answer(pod) == journey.answer
    (new,) = [p for p in fresh if p["metadata"]["uid"] not in {b["metadata"]["uid"] for b in before}]
    assert restored(new), metric(new, "keepwarm_startup_source_total")


def restored(pod: dict[str, Any]) -> bool:
    """The pod's supervising parent came from the node's snapshot, not from its own imports."""
    return metric(pod, "keepwarm_startup_source_total") == {"snapshot": 1.0}


def snapshots(cp: ControlPlane) -> list[dict[str, Any]]:
    """The snapshots the journey's WeightCacheNode reports (status.snapshots)."""
    wcn = resident_node(cp, WC) or {}
    return (wcn.get("status") or {}).get("snapshots", [])


def test_killed_worker_is_replaced_inside_the_running_container(journey: SimpleNamespace) -> None:
    """SIGKILL of the serving worker (PID 1's child): the supervising parent forks a new one on the
    same listening socket, so the container is not restarted and the request sent right after the
    kill waits in the backlog and is answered."""
    cp = journey.cp
    pod = ready_pods(cp, APPS, RUNTIME, 2)[0]
    assert cp.nodes is not None
    parent, serving = serving_chain(cp.nodes.container_pid(pod))  # PID 1 is a launcher if restored
    os.kill(serving, signal.SIGKILL)
    assert answer(pod) == journey.answer
    now = get(cp, f"/api/v1/namespaces/{APPS}/pods/{pod['metadata']['name']}")
    assert now["status"]["containerStatuses"][0]["restartCount"] == 0
    replacement = children(parent)
    assert replacement and replacement != [serving]


def test_killed_runtime_restarts_in_place_and_answers(journey: SimpleNamespace) -> None:
    cp = journey.cp
    pod = ready_pods(cp, APPS, RUNTIME, 2)[0]
    assert cp.nodes is not None
    os.kill(cp.nodes.container_pid(pod), signal.SIGKILL)

    def restarted() -> dict[str, Any] | None:
        now = get(cp, f"/api/v1/namespaces/{APPS}/pods/{pod['metadata']['name']}")
        status = (now or {}).get("status", {}).get("containerStatuses", [{}])[0]
        return now if status.get("restartCount") == 1 and is_ready(now) else None

    again = cp.wait_for(restarted, timeout_s=300, what="the killed runtime restarted and Ready")
    last = again["status"]["containerStatuses"][0]["lastState"]["terminated"]
    assert last["exitCode"] == 137
    assert answer(again) == journey.answer
    assert restored(again)  # the restarted container restored its parent too


def test_scale_to_zero_and_back(journey: SimpleNamespace) -> None:
    cp = journey.cp
    cp.kubectl("scale", "-n", APPS, f"inferencedeployment/{IDEP}", "--replicas=0")
    cp.wait_for(lambda: not pods(cp, APPS, RUNTIME), timeout_s=180, what="no runtime pods")
    cp.kubectl("scale", "-n", APPS, f"inferencedeployment/{IDEP}", "--replicas=1")
    (pod,) = cp.wait_for(lambda: ready_pods(cp, APPS, RUNTIME, 1), timeout_s=300, what="1 runtime pod Ready")
    assert answer(pod) == journey.answer
    assert set(metric(pod, "keepwarm_weight_load_seconds")) == {"cache"}
    assert restored(pod)
    # One snapshot served every restore (delete, crash, scale-up); the agent's status catches up.
    cp.wait_for(
        lambda: [s["restores"] for s in snapshots(cp)] == [3], timeout_s=120, what="3 restores in status"
    )


# How stale an endpoints consumer's view may be: each client thread re-reads the pods from the API
# server, then sends to what it read for this long (EndpointSlices and kube-proxies lag about as much).
ENDPOINTS_LAG_S = 1.0


@dataclass
class Traffic:
    """Client threads sending requests all the time to the Ready, non-terminating runtime pods, as a
    Service's clients do; every answer and every failure is kept, by pod."""

    cp: ControlPlane
    threads: int = 3
    stop: threading.Event = field(default_factory=threading.Event)
    answers: dict[str, list[str]] = field(default_factory=dict)  # pod uid -> answers
    failures: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _workers: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        self._workers = [threading.Thread(target=self._loop, daemon=True) for _ in range(self.threads)]
        for worker in self._workers:
            worker.start()

    def finish(self) -> None:
        self.stop.set()
        for worker in self._workers:
            worker.join(timeout=180)

    def count(self, uid: str) -> int:
        with self._lock:
            return len(self.answers.get(uid, []))

    def _loop(self) -> None:
        clients: dict[str, openai.OpenAI] = {}  # by pod uid: each keeps its connections alive
        while not self.stop.is_set():
            try:
                endpoints = [p for p in pods(self.cp, APPS, RUNTIME) if is_ready(p)]
            except httpx.HTTPError:  # the API server busy: no endpoints news, not a failed request
                time.sleep(0.1)
                continue
            until = time.monotonic() + ENDPOINTS_LAG_S
            while endpoints and time.monotonic() < until and not self.stop.is_set():
                for pod in endpoints:
                    uid = pod["metadata"]["uid"]
                    try:
                        out = clients.setdefault(uid, client(pod)).chat.completions.create(
                            model=MODEL, messages=PROMPT, max_tokens=8, temperature=0
                        )
                    except Exception as exc:  # every failure counts, whatever its kind
                        with self._lock:
                            self.failures.append(f"{pod['metadata']['name']}: {type(exc).__name__}: {exc}")
                        continue
                    with self._lock:
                        self.answers.setdefault(uid, []).append(out.choices[0].message.content or "")


def test_a_restarted_agent_leaves_serving_pods_serving(journey: SimpleNamespace) -> None:
    """The agent pod deleted while a runtime pod serves: the runtime keeps answering from its mapping
    all along, and the DaemonSet's new agent has the model again (the next step's new pod attaches
    to it)."""
    cp = journey.cp
    (pod,) = ready_pods(cp, APPS, RUNTIME, 1)
    (agent,) = ready_pods(cp, NAMESPACE, AGENTS, 1)
    uid = pod["metadata"]["uid"]
    traffic = Traffic(cp)
    traffic.start()
    try:
        cp.wait_for(lambda: traffic.count(uid) >= 3, timeout_s=120, what="traffic flowing")
        cp.kubectl("delete", "pod", "-n", NAMESPACE, agent["metadata"]["name"], "--wait=true", timeout=180)
        (fresh_agent,) = cp.wait_for(
            lambda: ready_pods(cp, NAMESPACE, AGENTS, 1), timeout_s=240, what="the new agent pod Ready"
        )
        assert fresh_agent["metadata"]["uid"] != agent["metadata"]["uid"]
        cp.wait_for(lambda: resident_node(cp, WC), timeout_s=240, what="the model resident again")
        # The node's status may still be the old agent's record (an unchanged status is not written
        # again), so the new agent's daemon is asked itself: the next step's pod attaches to it.
        cp.wait_for(
            lambda: sample_sum(agent_metrics(fresh_agent), "keepwarm_cache_resident_bytes", model=MODEL) > 0,
            timeout_s=240,
            what="the new agent's daemon holding the model",
        )
        served = traffic.count(uid)
        cp.wait_for(lambda: traffic.count(uid) >= served + 3, timeout_s=120, what="the pod still serving")
    finally:
        traffic.finish()
    assert traffic.failures == []
    assert set(traffic.answers) == {uid}
    assert set(traffic.answers[uid]) == {journey.answer}


def test_a_spec_change_rolls_with_no_request_failing(journey: SimpleNamespace) -> None:
    """maxUnavailable 0: the old pod serves until the new one is Ready, then serves through its preStop
    sleep while clients stop picking it, and drains; not one request of the clients fails. The new
    pod attaches to the node cache of the agent restarted in the previous step, not to disk."""
    cp = journey.cp
    (old,) = ready_pods(cp, APPS, RUNTIME, 1)
    traffic = Traffic(cp)
    traffic.start()
    try:
        cp.wait_for(lambda: traffic.count(old["metadata"]["uid"]) >= 3, timeout_s=120, what="traffic flowing")
        env = [{"name": "JOURNEY_ROLLOUT", "value": "1"}]  # a pod template change
        cp.kubectl(
            "patch",
            "-n",
            APPS,
            f"inferencedeployment/{IDEP}",
            "--type=merge",
            "-p",
            json.dumps({"spec": {"env": env}}),
        )

        def rolled() -> dict[str, Any] | None:
            now = pods(cp, APPS, RUNTIME)
            fresh = [p for p in now if p["metadata"]["uid"] != old["metadata"]["uid"] and is_ready(p)]
            return fresh[0] if len(now) == 1 and fresh else None

        new = cp.wait_for(rolled, timeout_s=300, what="the new pod Ready and the old one gone")
        cp.wait_for(
            lambda: traffic.count(new["metadata"]["uid"]) >= 3, timeout_s=120, what="the new pod serving"
        )
    finally:
        traffic.finish()
    assert traffic.failures == []
    assert {"name": "JOURNEY_ROLLOUT", "value": "1"} in new["spec"]["containers"][0]["env"]
    assert set(traffic.answers) == {old["metadata"]["uid"], new["metadata"]["uid"]}
    assert {a for answers in traffic.answers.values() for a in answers} == {journey.answer}
    loads = metric(new, "keepwarm_weight_load_seconds")
    # A miss names its reason (the client's counter): what the pod met on the node, should it go to disk.
    assert set(loads) == {"cache"}, (loads, metric(new, "keepwarm_cache_client_misses_total", "reason"))


def test_removing_the_model_keeps_serving_pods_serving(journey: SimpleNamespace) -> None:
    """As the README says: the Deployment is left alone (Available False, ModelNotInCache), the agent
    is not restarted, and a pod that attached keeps serving from its mapping after the eviction."""
    cp = journey.cp
    (pod,) = ready_pods(cp, APPS, RUNTIME, 1)
    (agent,) = pods(cp, NAMESPACE, AGENTS)
    cp.kubectl("patch", "weightcache", WC, "--type=merge", "-p", '{"spec": {"models": []}}')

    def evicted() -> bool:
        wcns = items(cp, f"{GROUP_PATH}/weightcachenodes?labelSelector=keepwarm.dev/weightcache={WC}")
        return bool(wcns) and all(not (w.get("status") or {}).get("models") for w in wcns)

    cp.wait_for(evicted, timeout_s=120, what="the model gone from the WeightCacheNode")
    idep_path = f"{GROUP_PATH}/namespaces/{APPS}/inferencedeployments/{IDEP}"
    cp.wait_for(
        lambda: condition(get(cp, idep_path), "Available").get("reason") == "ModelNotInCache",
        timeout_s=120,
        what="the InferenceDeployment saying ModelNotInCache",
    )
    assert answer(pod) == journey.answer
    (still,) = pods(cp, APPS, RUNTIME)
    assert still["metadata"]["uid"] == pod["metadata"]["uid"] and is_ready(still)
    (agent_now,) = pods(cp, NAMESPACE, AGENTS)
    assert agent_now["metadata"]["uid"] == agent["metadata"]["uid"]
    assert agent_now["status"]["containerStatuses"][0]["restartCount"] == 0


def test_uninstall_leaves_nothing_behind(journey: SimpleNamespace) -> None:
    cp = journey.cp
    cp.kubectl("delete", "-n", APPS, "inferencedeployment", IDEP, "--wait=true", timeout=180)
    cp.kubectl("delete", "weightcache", WC, "--wait=true", timeout=180)
    with helm.Config(kubeconfig_path=str(cp.kubeconfig), namespace=NAMESPACE) as cfg:
        cfg.uninstall(RELEASE, timeout=120)
    cp.kubectl("delete", "namespace", APPS, NAMESPACE, "--wait=true", timeout=240)
    assert cp.nodes is not None
    # The kubelet removes a deleted pod's sandbox, volumes, cgroups and network (its veth on the
    # bridge) once its containers stopped; the cluster's stop then checks the node itself left nothing.
    cp.wait_for(lambda: not cp.nodes.pod_remains(), timeout_s=180, what="every pod gone from the node")
