"""The operator end to end on a real control plane, running as the chart's ServiceAccount.

One WeightCache and one InferenceDeployment go through their life in order (tests share module
state): DaemonSet on exactly the selected GPU nodes, agent reports aggregated, Deployment + Service on
the warm nodes, kubectl scale, a rolling spec change, restart without duplicates, stale and vanished
nodes, garbage collection. Missing RBAC in the chart fails these tests (the operator gets 403s).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import shutil
import time
import uuid
from types import SimpleNamespace

import pytest
import yaml

from keepwarm_api import API_VERSION
from keepwarm_api.lease import node_lease
from keepwarm_api.weightcachenode import KIND as NODE_KIND
from keepwarm_api.weightcachenode import ResidentModel
from keepwarm_api.weightcachenode import agent_status as wcn_status
from keepwarm_operator.builders.meta import warm_label_key
from keepwarm_testing.operator import (
    GROUP_PATH,
    IMPLIED_GRANTS,
    NAMESPACE,
    OPERATOR_SA,
    RACE_ONLY_GRANTS,
    OperatorProcess,
    condition,
    get,
    granted,
    install_chart_rbac,
    install_crds,
    install_lws_crds,
    items,
    render_chart,
    used,
    wait,
)

pytestmark = pytest.mark.slow
WC, MODEL, IDEP = "kwe2e", "tiny", "chat"
WARM = warm_label_key(WC, MODEL)
RECONCILES = "keepwarm_operator_reconcile_total"
PVC = {"pvc": {"claimName": "adapters"}}  # a LoRA adapter source


@pytest.fixture(scope="module")
def env(control_plane, tmp_path_factory):
    cp = control_plane
    started = time.time()
    install_crds(cp)
    install_chart_rbac(cp)
    lws_crds = install_lws_crds(cp)  # removed at the end: other modules run without the LWS API
    runtime_class = {
        "apiVersion": "node.k8s.io/v1",
        "kind": "RuntimeClass",
        "metadata": {"name": "nvidia"},
        "handler": "nvidia",
    }
    cp.kubectl("apply", "-f", "-", input=json.dumps(runtime_class))
    pool = f"kw{uuid.uuid4().hex[:5]}"
    nodes = cp.add_gpu_nodes(3, labels={"pool": pool}, prefix=f"{pool}-gpu")
    other = cp.add_gpu_nodes(1, labels={"pool": f"{pool}-x"}, prefix=f"{pool}-cpu")
    ns = f"{pool}-apps"
    cp.kubectl("create", "namespace", ns)
    op = OperatorProcess(cp, tmp_path_factory.mktemp("operator")).start()
    yield SimpleNamespace(cp=cp, op=op, pool=pool, nodes=nodes, other=other, ns=ns, started=started)
    op.stop()
    cp.kubectl("delete", "crd", *lws_crds, "--wait=true")


def apply(env, doc: dict, *, check: bool = True, kubeconfig=None):
    return env.cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc), check=check, kubeconfig=kubeconfig)


def weightcache(name: str, pool: str, **spec) -> dict:
    base = {
        "tier": "gpu",
        "nodeSelector": {"pool": pool},
        "heartbeatSeconds": 600,
        "models": [{"name": MODEL, "source": {"path": "/var/lib/models/tiny"}, "pin": True}],
    }
    return {
        "apiVersion": "keepwarm.dev/v1alpha1",
        "kind": "WeightCache",
        "metadata": {"name": name},
        "spec": {**base, **spec},
    }


def inference(name: str, ns: str, pool: str, **spec) -> dict:
    base = {
        "model": {"cacheRef": WC, "name": MODEL},
        "replicas": 2,
        "gpusPerPod": 1,
        "pod": {"nodeSelector": {"pool": pool}},
    }
    return {
        "apiVersion": "keepwarm.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": name, "namespace": ns},
        "spec": {**base, **spec},
    }


def wc(env, name=WC):
    return get(env.cp, f"{GROUP_PATH}/weightcaches/{name}")


def idep(env, name=IDEP):
    return get(env.cp, f"{GROUP_PATH}/namespaces/{env.ns}/inferencedeployments/{name}")


def wcns(env, cache=WC):
    return items(env.cp, f"{GROUP_PATH}/weightcachenodes?labelSelector=keepwarm.dev/weightcache={cache}")


def runtime_pods(env, name=IDEP):
    pods = items(
        env.cp, f"/api/v1/namespaces/{env.ns}/pods?labelSelector=keepwarm.dev/inferencedeployment={name}"
    )
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def agent_kubeconfig(env, node: str, cache: str = WC):
    """The agent ServiceAccount's token bound to the agent pod on `node` (as its kubelet mounts it)."""
    pods = items(
        env.cp, f"/api/v1/namespaces/{NAMESPACE}/pods?labelSelector=keepwarm.dev/weightcache={cache}"
    )
    pod = next(p for p in pods if p["spec"].get("nodeName") == node)
    return env.cp.service_account_kubeconfig(
        NAMESPACE, f"keepwarm-agent-{cache}", create=False, bound_pod=pod
    )


def agent_status(*states: str) -> dict:
    """The status patch an agent holding MODEL in these states sends, built by the product's function."""
    models = [ResidentModel(name=MODEL, state=s, bytes=1 << 20, fingerprint="f", tier="gpu") for s in states]
    now = dt.datetime.now(dt.UTC).replace(microsecond=0)
    return {"status": wcn_status(models, [], "e2e", "", now, now).wire()}


def test_weightcache_runs_agents_on_exactly_the_selected_nodes(env):
    apply(env, weightcache(WC, env.pool))
    ds_path = f"/apis/apps/v1/namespaces/{NAMESPACE}/daemonsets/keepwarm-agent-{WC}"
    ds = wait(
        env.cp,
        lambda: (
            (get(env.cp, ds_path) or {}).get("status", {}).get("numberReady") == 3 and get(env.cp, ds_path)
        ),
        "agent DaemonSet with 3 ready pods",
        op=env.op,
    )
    pods = items(env.cp, f"/api/v1/namespaces/{NAMESPACE}/pods?labelSelector=keepwarm.dev/weightcache={WC}")
    assert sorted(p["spec"]["nodeName"] for p in pods) == sorted(env.nodes)
    owner = wc(env)
    assert ds["metadata"]["ownerReferences"][0]["uid"] == owner["metadata"]["uid"]
    pod = pods[0]["spec"]
    assert pod["runtimeClassName"] == "nvidia" and pod["serviceAccountName"] == f"keepwarm-agent-{WC}"
    assert "nvidia.com/gpu" not in json.dumps(pod["containers"][0].get("resources", {}))
    wanted = {f"{WC}.{n}" for n in env.nodes}
    wait(
        env.cp,
        lambda: {o["metadata"]["name"] for o in wcns(env)} == wanted,
        "one WeightCacheNode per node",
        op=env.op,
    )
    for obj in wcns(env):
        assert obj["metadata"]["ownerReferences"][0]["uid"] == owner["metadata"]["uid"]
    status = wait(
        env.cp,
        lambda: (wc(env).get("status") or {}).get("desiredNodes") == 3 and wc(env)["status"],
        "WeightCache status",
        op=env.op,
    )
    assert status["observedGeneration"] == owner["metadata"]["generation"]
    assert condition(wc(env), "Ready")["reason"] == "NodesNotReady"


def _template_hash(env) -> tuple[str, int]:
    """The agent DaemonSet's pod template hash, and its generation (a rollout would bump it)."""
    ds = get(env.cp, f"/apis/apps/v1/namespaces/{NAMESPACE}/daemonsets/keepwarm-agent-{WC}")
    digest = hashlib.sha256(json.dumps(ds["spec"]["template"], sort_keys=True).encode()).hexdigest()
    return digest, ds["metadata"]["generation"]


def test_adding_a_model_changes_the_weightcachenodes_not_the_agent_pods(env):
    """Models reach agents through their WeightCacheNode specs (a Hub token through a Role naming its
    Secret): the DaemonSet's pod template stays the same, so no agent restarts and no cache drops."""
    cp, before = env.cp, _template_hash(env)
    secret = f"{WC}-hf"
    hub = {"huggingFace": {"repo": "org/gated", "revision": "main", "tokenSecretRef": {"name": secret}}}
    models = [*weightcache(WC, env.pool)["spec"]["models"], {"name": "extra", "source": hub}]
    cp.kubectl("patch", "wc", WC, "--type=merge", "-p", json.dumps({"spec": {"models": models}}))

    def spec_models():
        return {o["spec"]["nodeName"]: [m["name"] for m in o["spec"].get("models", [])] for o in wcns(env)}

    wanted = {n: [MODEL, "extra"] for n in env.nodes}
    wait(cp, lambda: spec_models() == wanted, "every WeightCacheNode spec holds both models", op=env.op)
    role_path = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NAMESPACE}/roles/keepwarm-agent-{WC}"
    role = get(cp, role_path)
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create", "patch"]},
        {"apiGroups": [""], "resources": ["secrets"], "resourceNames": [secret], "verbs": ["get"]},
    ]
    assert _template_hash(env) == before
    cp.kubectl("patch", "wc", WC, "--type=merge", "-p", json.dumps({"spec": {"models": models[:1]}}))
    wait(cp, lambda: spec_models() == {n: [MODEL] for n in env.nodes}, "the model removed again", op=env.op)
    wait(
        cp,
        lambda: all("secrets" not in r["resources"] for r in get(cp, role_path)["rules"]),
        "the Secret rule dropped",
        op=env.op,
    )
    assert _template_hash(env) == before


def test_agent_reports_aggregate_into_weightcache_status(env, tiny_llama, tmp_path):
    """Node 0 runs the real agent code with a real CacheDaemon; node 1 is written as an agent would."""
    from keepwarm_api.kube import AGENT_FIELD_MANAGER, ApiError
    from keepwarm_runtime.agent.kubernetes import NodeAgent
    from keepwarm_runtime.cache.daemon import CacheDaemon, DaemonConfig

    cp = env.cp
    agent_kc = agent_kubeconfig(env, env.nodes[0])  # as the agent pod on node 0 gets it from its kubelet
    (tmp_path / "models").mkdir()
    shutil.copytree(tiny_llama, tmp_path / "models" / MODEL)
    daemon = CacheDaemon(DaemonConfig(socket_dir=tmp_path / "sock", tier="host", dtype="bfloat16"))
    try:
        kube = cp.kube(agent_kc, AGENT_FIELD_MANAGER)
        agent = NodeAgent(
            daemon, WC, env.nodes[0], kube, namespace=NAMESPACE, host_root=str(tmp_path / "models")
        )
        agent.reconcile(agent.fetch())  # the models the operator wrote into this node's spec
        agent.settle()
        assert agent.report()
        node0_path = f"{GROUP_PATH}/weightcachenodes/{WC}.{env.nodes[0]}"
        written = get(cp, node0_path)["metadata"]["resourceVersion"]
        assert agent.report() and agent.renew() and agent.renew()  # a heartbeat: the Lease only
        assert get(cp, node0_path)["metadata"]["resourceVersion"] == written
        lease = get(cp, f"/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases/{WC}.{env.nodes[0]}")
        assert lease["spec"]["holderIdentity"] == env.nodes[0] and lease["spec"]["renewTime"]
        assert lease["metadata"]["ownerReferences"][0]["uid"] == get(cp, node0_path)["metadata"]["uid"]
    finally:
        daemon.close()
    node0 = get(cp, f"{GROUP_PATH}/weightcachenodes/{WC}.{env.nodes[0]}")["status"]
    assert node0["phase"] == "Ready" and node0["models"][0]["state"] == "Resident" and node0["totalBytes"] > 0
    patch = json.dumps(agent_status("Resident"))
    # The agent of node 0 may not write node 1's status (the chart's ValidatingAdmissionPolicy)...
    node1, body = f"{WC}.{env.nodes[1]}", json.loads(patch)
    with pytest.raises(ApiError) as refused:
        kube.merge_patch(API_VERSION, NODE_KIND, node1, body, status=True)
    assert refused.value.status == 403 and "its own node" in refused.value.message
    # ... nor keep node 1 looking alive through its Lease.
    lease = node_lease(node1, NAMESPACE, WC, env.nodes[1], 60, dt.datetime.now(dt.UTC), None)
    with pytest.raises(ApiError) as refused:
        kube.apply(lease, manager="e2e")
    assert refused.value.status == 403 and "its own node" in refused.value.message
    own = cp.kube(agent_kubeconfig(env, env.nodes[1]), AGENT_FIELD_MANAGER)
    own.merge_patch(API_VERSION, NODE_KIND, node1, body, status=True)

    def two_ready():
        s = wc(env)["status"]
        return s["readyNodes"] == 2 and s["models"] == [{"name": MODEL, "residentNodes": 2, "failedNodes": 0}]

    wait(cp, two_ready, "2 nodes ready, model resident on 2", op=env.op)
    assert condition(wc(env), "Ready")["status"] == "False"

    def labels(node):
        return get(cp, f"/api/v1/nodes/{node}")["metadata"].get("labels", {})

    wait(cp, lambda: all(labels(n).get(WARM) == "true" for n in env.nodes[:2]), "warm labels", op=env.op)
    assert WARM not in labels(env.nodes[2])
    # Least privilege: the agent may write status, nothing else.
    forbidden = [
        ("delete", "wcn", f"{WC}.{env.nodes[1]}"),
        ("patch", "wcn", f"{WC}.{env.nodes[1]}", "--type=merge", "-p", '{"spec":{"nodeName":"x"}}'),
        ("get", "pods", "-n", NAMESPACE),
    ]
    for args in forbidden:
        result = cp.kubectl(*args, kubeconfig=agent_kc, check=False)
        assert result.returncode != 0 and "forbidden" in result.stderr.lower(), (args, result.stderr)


def test_inference_deployment_prefers_warm_nodes_and_becomes_available(env):
    apply(env, inference(IDEP, env.ns, env.pool))
    dep_path = f"/apis/apps/v1/namespaces/{env.ns}/deployments/{IDEP}"
    wait(
        env.cp,
        lambda: (get(env.cp, dep_path) or {}).get("status", {}).get("readyReplicas") == 2,
        "Deployment with 2 ready replicas",
        op=env.op,
    )
    assert get(env.cp, f"/api/v1/namespaces/{env.ns}/services/{IDEP}")["spec"]["ports"][0]["port"] == 8000
    assert sorted(p["spec"]["nodeName"] for p in runtime_pods(env)) == sorted(env.nodes[:2])

    def available():
        obj = idep(env)
        return (
            condition(obj, "Available").get("status") == "True"
            and obj["status"]["readyReplicas"] == 2
            and obj
        )

    obj = wait(env.cp, available, "InferenceDeployment Available", op=env.op)
    assert (
        obj["status"]["selector"]
        == "app.kubernetes.io/instance=chat,app.kubernetes.io/name=keepwarm-runtime,"
        "keepwarm.dev/inferencedeployment=chat"
    )
    assert condition(obj, "CacheWarm")["reason"] == "ModelResident" and obj["status"]["warmNodes"] == 2
    assert obj["status"]["observedGeneration"] == obj["metadata"]["generation"]
    pod = runtime_pods(env)[0]["spec"]
    env_vars = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env_vars["KEEPWARM_CACHE_SOCKET_DIR"] == f"/var/run/keepwarm/{WC}"
    assert pod["securityContext"]["supplementalGroups"] == [2000]


def test_kubectl_scale_drives_replicas_through_the_scale_subresource(env):
    before = _reconciles(env)
    env.cp.kubectl("scale", "idep", IDEP, "-n", env.ns, "--replicas=3")
    dep_path = f"/apis/apps/v1/namespaces/{env.ns}/deployments/{IDEP}"
    wait(env.cp, lambda: get(env.cp, dep_path)["status"].get("readyReplicas") == 3, "3 ready", op=env.op)
    wait(env.cp, lambda: idep(env)["status"]["replicas"] == 3, "status.replicas 3", op=env.op)
    scale = json.loads(
        env.cp.kubectl("get", "idep", IDEP, "-n", env.ns, "--subresource=scale", "-o", "json").stdout
    )
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 3
    assert scale["status"]["selector"] == idep(env)["status"]["selector"]
    # The operator reconciled the change (and the rollout's Deployment events) without writing
    # spec.replicas back: the scale subresource, like an HPA, stays the owner of the count.
    assert _reconciles(env) >= before + 2
    assert idep(env)["spec"]["replicas"] == 3 and get(env.cp, dep_path)["spec"]["replicas"] == 3
    env.cp.kubectl("scale", "idep", IDEP, "-n", env.ns, "--replicas=2")
    wait(env.cp, lambda: len(runtime_pods(env)) == 2, "scaled back to 2", op=env.op)


def _reconciles(env) -> float:
    reconciles = env.op.samples(RECONCILES)
    return sum(s.value for s in reconciles if s.labels["kind"] == "InferenceDeployment")


def test_spec_change_rolls_the_pods(env):
    old = {p["metadata"]["name"] for p in runtime_pods(env)}
    env.cp.kubectl(
        "patch",
        "idep",
        IDEP,
        "-n",
        env.ns,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"env": [{"name": "ROLL", "value": "1"}]}}),
    )

    def rolled():
        obj = idep(env)
        pods = runtime_pods(env)
        new = {p["metadata"]["name"] for p in pods}
        done = condition(obj, "Progressing").get("reason") == "RolloutComplete"
        return (
            done
            and len(pods) == 2
            and not (new & old)
            and obj["status"]["observedGeneration"] == obj["metadata"]["generation"]
        )

    wait(env.cp, rolled, "new pods from the changed spec", timeout_s=90, op=env.op)
    pod = runtime_pods(env)[0]["spec"]["containers"][0]
    assert {"name": "ROLL", "value": "1"} in pod["env"]
    assert condition(idep(env), "Available")["status"] == "True"


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (
            lambda p: weightcache(
                "bad1",
                p,
                models=[{"name": "m", "source": {"path": "/var/lib/models/a", "pvc": {"claimName": "c"}}}],
            ),
            "set exactly one of source.path, source.pvc, source.huggingFace",
        ),
        (lambda p: weightcache("bad3", p, tier="tpu"), 'Unsupported value: "tpu"'),
        (
            lambda p: weightcache(
                "bad4", p, models=[{"name": "m", "source": {"path": "/var/lib/models/a"}}] * 2
            ),
            "Duplicate value",
        ),
        (lambda p: inference("bad5", "default", p, replicas=-1), "spec.replicas: Invalid value: -1"),
        (lambda p: inference("bad6", "default", p, model={"cacheRef": WC}), "set either cacheRef and name"),
        (
            lambda p: weightcache(
                "bad7",
                p,
                models=[
                    {"name": "a", "source": {"path": "/var/lib/models/a"}},
                    {"name": "b", "source": {"path": "/var/lib/models/b"}, "dtype": "float16"},
                ],
            ),
            "all models of a WeightCache share one dtype",
        ),
        (
            lambda p: weightcache("bad8", p, socket={"groupId": 5, "allowedGids": [7]}),
            "socket.groupId must be one of socket.allowedGids",
        ),
        (
            lambda p: weightcache("bad9", p, models=[{"name": "m", "source": {"path": "/etc/kubernetes"}}]),
            "source.path must lie under spec.modelDirectory",
        ),
        (
            lambda p: inference("bad10", "default", p, lora={"maxLoras": 0}),
            "spec.lora.maxLoras: Invalid value: 0",
        ),
        (
            lambda p: inference("bad11", "default", p, lora={"adapters": [{"name": "a", "source": PVC}] * 2}),
            "Duplicate value",
        ),
        (
            lambda p: inference(
                "bad12",
                "default",
                p,
                lora={"adapters": [{"name": "a", "source": {**PVC, "containerPath": "/a"}}]},
            ),
            "set exactly one of source.cached, source.pvc, source.containerPath",
        ),
        (
            lambda p: inference("bad13", "default", p, lora={"adapters": [{"name": MODEL, "source": PVC}]}),
            "a LoRA adapter cannot take the served model's name",
        ),
        (
            lambda p: inference(
                "bad14",
                "default",
                p,
                model={"source": {"path": "/var/lib/models/tiny"}},
                lora={"adapters": [{"name": "a", "source": {"cached": "a"}}]},
            ),
            "source.cached names an adapter of the served model in its WeightCache: it needs",
        ),
        (
            # 17 + 1 + 40 characters: a GPU's socket under it would pass AF_UNIX's 107 bytes
            lambda p: weightcache("b" * 40, p, socket={"directory": "/var/run/keepwarm"}),
            "a Unix socket path is at most 107 bytes",
        ),
    ],
    ids=[
        "two-sources",
        "bad-tier",
        "duplicate-model",
        "negative-replicas",
        "cacheref-no-name",
        "mixed-dtypes",
        "group-not-allowed",
        "path-outside-model-directory",
        "lora-no-slots",
        "lora-duplicate-adapter",
        "lora-two-sources",
        "lora-adapter-named-like-the-model",
        "lora-cached-without-cache-ref",
        "gpu-socket-path-too-long",
    ],
)
def test_invalid_resources_are_rejected_by_the_api_server(env, doc, message):
    result = apply(env, doc(env.pool), check=False)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


def test_fp8_on_the_host_tier_is_accepted(env):
    """The daemon quantizes at load on either tier, so the API server takes fp8 with tier host."""
    models = [{"name": "m", "source": {"path": "/var/lib/models/a"}, "quantization": "fp8"}]
    doc = weightcache("fp8host", env.pool, tier="host", models=models)
    result = env.cp.kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump(doc), check=False)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    ("name", "tier"), [("b" * 40, "host"), ("b" * 39, "gpu")], ids=["host-tier", "gpu-at-the-limit"]
)
def test_socket_paths_that_fit_are_accepted(env, name, tier):
    """host.sock is short, so the host tier keeps 40-character names; on the gpu tier 17 + 1 + 39
    characters of directory leave room for gpu-<GPU UUID>.sock within 107 bytes."""
    doc = weightcache(name, env.pool, tier=tier, socket={"directory": "/var/run/keepwarm"})
    result = env.cp.kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump(doc), check=False)
    assert result.returncode == 0, result.stderr


def test_a_lora_section_is_accepted_with_its_adapter_names_intact(env):
    """The CEL rules compile and pass a good spec: adapters from a pvc and a containerPath, inline model
    named by metadata.name."""
    lora = {
        "maxLoras": 2,
        "maxLoraRank": 16,
        "adapters": [{"name": "sql", "source": PVC}, {"name": "de", "source": {"containerPath": "/opt/de"}}],
    }
    doc = inference(
        "lora", "default", env.pool, model={"source": {"path": "/var/lib/models/tiny"}}, lora=lora
    )
    result = env.cp.kubectl(
        "apply", "--dry-run=server", "-o", "json", "-f", "-", input=yaml.safe_dump(doc), check=False
    )
    assert result.returncode == 0, result.stderr
    stored = json.loads(result.stdout)["spec"]["lora"]
    assert [a["name"] for a in stored["adapters"]] == ["sql", "de"]
    assert stored["enabled"] is True and stored["allowRuntimeUpdating"] is False  # defaults

    def explained():  # the API server publishes a new CRD's schema to kubectl explain asynchronously
        out = env.cp.kubectl("explain", "idep.spec.lora.adapters.source", check=False).stdout
        return "containerPath" in out and "pvc" in out and "cached" in out and "exactly one" in out

    wait(env.cp, explained, "kubectl explain of spec.lora.adapters.source")


def refused_with(env, name: str, reason: str) -> str:
    """Wait for the InferenceDeployment's Available condition to carry `reason`; no Deployment was
    applied. Returns the condition's message."""
    obj = wait(
        env.cp,
        lambda: condition(idep(env, name), "Available").get("reason") == reason and idep(env, name),
        f"{reason} condition",
        op=env.op,
    )
    assert get(env.cp, f"/apis/apps/v1/namespaces/{env.ns}/deployments/{name}") is None
    return condition(obj, "Available")["message"]


def test_an_adapter_the_cache_does_not_list_is_a_condition(env):
    """spec.lora names a cached adapter the WeightCache's model lacks: AdapterNotInCache naming it and
    what the model has; no Deployment (its pods would fail to start on the missing adapter)."""
    lora = {"adapters": [{"name": "sql", "source": {"cached": "nope"}}]}
    apply(env, inference("no-adapter", env.ns, env.pool, lora=lora))
    message = refused_with(env, "no-adapter", "AdapterNotInCache")
    assert "'nope'" in message and f"model {MODEL!r}" in message and "(it has: none)" in message
    env.cp.kubectl("delete", "idep", "no-adapter", "-n", env.ns)


def test_a_new_adapter_list_changes_the_configmap_not_the_pods(env):
    """spec.lora's adapters reach the pods through a ConfigMap they mount (the runtime follows the
    file): a new list rewrites the ConfigMap and leaves the Deployment's generation as it was (no
    rollout); a deleted ConfigMap is restored by the resync."""
    from keepwarm_api.paths import LORA_LIST_FILE
    from keepwarm_operator.builders.runtime import lora_list_name

    name = "lora-list"
    cm_path = f"/api/v1/namespaces/{env.ns}/configmaps/{lora_list_name(name)}"
    dep_path = f"/apis/apps/v1/namespaces/{env.ns}/deployments/{name}"

    def listed() -> dict[str, str] | None:
        cm = get(env.cp, cm_path)
        return cm and {e["name"]: e["path"] for e in json.loads(cm["data"][LORA_LIST_FILE])}

    def adapters(*names: str) -> list[dict]:
        return [{"name": n, "source": {"containerPath": f"/opt/{n}"}} for n in names]

    apply(env, inference(name, env.ns, env.pool, replicas=0, lora={"adapters": adapters("a")}))
    wait(
        env.cp,
        lambda: get(env.cp, dep_path) and listed() == {"a": "/opt/a"},
        "Deployment and list",
        op=env.op,
    )
    generation = get(env.cp, dep_path)["metadata"]["generation"]
    apply(env, inference(name, env.ns, env.pool, replicas=0, lora={"adapters": adapters("a", "b")}))
    wait(env.cp, lambda: listed() == {"a": "/opt/a", "b": "/opt/b"}, "the new list", op=env.op)
    assert get(env.cp, dep_path)["metadata"]["generation"] == generation
    env.cp.kubectl("delete", "configmap", lora_list_name(name), "-n", env.ns)
    wait(env.cp, lambda: listed() == {"a": "/opt/a", "b": "/opt/b"}, "the list restored", op=env.op)
    assert get(env.cp, dep_path)["metadata"]["generation"] == generation
    env.cp.kubectl("delete", "idep", name, "-n", env.ns)


def test_missing_cache_is_a_condition_not_a_crash(env):
    apply(env, inference("orphan", env.ns, env.pool, model={"cacheRef": "no-such-cache", "name": MODEL}))
    assert "no-such-cache" in refused_with(env, "orphan", "CacheNotFound")
    assert env.op.healthy()
    env.cp.kubectl("delete", "idep", "orphan", "-n", env.ns)


def test_resyncs_write_nothing_when_nothing_changed(env):
    """Level-based resyncs (every 1 s here) that find nothing new leave every object untouched."""

    def versions():
        objs = [wc(env), idep(env), *wcns(env)]
        return {o["metadata"]["name"]: o["metadata"]["resourceVersion"] for o in objs}

    wait(
        env.cp,
        lambda: condition(idep(env), "Progressing").get("reason") == "RolloutComplete",
        "rollout settled",
        op=env.op,
    )
    time.sleep(2)  # in-flight refreshes land
    before = versions()
    time.sleep(4)  # four resync periods
    assert versions() == before


def test_a_namespace_that_leaves_allowed_namespaces_is_refused(env):
    """The API server refuses new InferenceDeployments outside allowedNamespaces (the chart's policy,
    test_tenancy_policy.py); one created before its namespace left the selector is the operator's to
    refuse, within a resync, and a new one there is refused by the API server."""
    cp, name, other = env.cp, "kwtenant", f"{env.pool}-other"
    banned = f"{env.pool}.e2e/banned"
    cp.kubectl("create", "namespace", other)
    allowed = {"matchExpressions": [{"key": banned, "operator": "DoesNotExist"}]}
    apply(env, weightcache(name, f"{env.pool}-none", allowedNamespaces=allowed))
    model = {"cacheRef": name, "name": MODEL}
    apply(env, inference("tenant", other, env.pool, model=model, replicas=0))
    apply(env, inference("tenant", env.ns, env.pool, model=model, replicas=0))

    def available(ns):
        obj = get(cp, f"{GROUP_PATH}/namespaces/{ns}/inferencedeployments/tenant")
        return condition(obj, "Available")

    wait(cp, lambda: available(other).get("status") == "True", "served while allowed", op=env.op)
    cp.kubectl("label", "namespace", other, f"{banned}=yes")
    refused = wait(
        cp, lambda: available(other).get("reason") == "NamespaceNotAllowed" and available(other), "refused",
        op=env.op,
    )  # fmt: skip
    assert refused["status"] == "False" and other in refused["message"]
    late = inference("late", other, env.pool, model=model, replicas=0)
    result = wait(
        cp,
        lambda: (r := apply(env, late, check=False)).returncode != 0 and r,
        "the API server refuses",
    )  # fmt: skip (the namespace's new label reaches the admission informer asynchronously)
    assert (
        f"namespace {other} is not selected by spec.allowedNamespaces of WeightCache {name}" in result.stderr
    )
    wait(cp, lambda: available(env.ns).get("status") == "True", "the allowed namespace is served", op=env.op)
    assert get(cp, f"/apis/apps/v1/namespaces/{env.ns}/deployments/tenant") is not None
    cp.kubectl("delete", "idep", "tenant", "-n", other)
    cp.kubectl("delete", "idep", "late", "-n", other, "--ignore-not-found")
    cp.kubectl("delete", "idep", "tenant", "-n", env.ns)
    cp.kubectl("delete", "wc", name)
    wait(
        cp,
        lambda: get(cp, f"/apis/apps/v1/namespaces/{env.ns}/deployments/tenant") is None,
        "the tenant Deployment garbage-collected",
    )


def test_deleted_service_and_overwritten_status_come_back_within_a_resync(env):
    cp = env.cp
    svc_path = f"/api/v1/namespaces/{env.ns}/services/{IDEP}"
    old_uid = get(cp, svc_path)["metadata"]["uid"]
    cp.kubectl("delete", "service", IDEP, "-n", env.ns)
    wait(cp, lambda: (get(cp, svc_path) or {}).get("metadata", {}).get("uid") not in (None, old_uid),
         "the Service recreated", timeout_s=30, op=env.op)  # fmt: skip
    ready = idep(env)["status"]["readyReplicas"]
    cp.kubectl(
        "patch", "idep", IDEP, "-n", env.ns, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": {"readyReplicas": 99, "warmNodes": 0}}),
    )  # fmt: skip
    cp.kubectl(
        "patch", "wc", WC, "--subresource=status", "--type=merge", "-p", '{"status": {"readyNodes": 99}}'
    )
    wait(
        cp,
        lambda: idep(env)["status"]["readyReplicas"] == ready and idep(env)["status"]["warmNodes"] == 2,
        "InferenceDeployment status restored",
        timeout_s=30,
        op=env.op,
    )
    wait(
        cp,
        lambda: wc(env)["status"]["readyNodes"] == 2,
        "WeightCache status restored",
        timeout_s=30,
        op=env.op,
    )
    # The agents' RBAC is only read on resync while unchanged; deleted, it is applied again.
    crb_path = f"/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/keepwarm-agent-{WC}"
    old_uid = get(cp, crb_path)["metadata"]["uid"]
    cp.kubectl("delete", "clusterrolebinding", f"keepwarm-agent-{WC}")
    wait(cp, lambda: (get(cp, crb_path) or {}).get("metadata", {}).get("uid") not in (None, old_uid),
         "the agents' ClusterRoleBinding recreated", timeout_s=30, op=env.op)  # fmt: skip


def _row(table: str, name: str) -> list[str]:
    """The cells of one object's row, starting at its NAME (with -A a NAMESPACE cell may come first)."""
    for line in table.splitlines():
        cells = line.split()
        if name in cells:
            return cells[cells.index(name) :]
    raise AssertionError(f"{name} not in:\n{table}")


def test_kubectl_printer_columns_and_explain(env):
    out = env.cp.kubectl("get", "wc,idep", "-A").stdout
    assert all(
        h in out
        for h in ("TIER", "MODELS", "DESIRED", "READY", "STATUS", "MODEL", "CACHE", "WARM", "AVAILABLE")
    )
    assert _row(out, f"weightcache.keepwarm.dev/{WC}")[1:5] == ["gpu", "1", "3", "2"]
    assert _row(out, f"inferencedeployment.keepwarm.dev/{IDEP}")[1:7] == [MODEL, WC, "2", "2", "2", "True"]
    wcn_out = env.cp.kubectl("get", "wcn").stdout
    assert "PHASE" in wcn_out and f"{WC}.{env.nodes[0]}" in wcn_out
    explain = env.cp.kubectl("explain", "weightcache.spec").stdout
    assert "Desired state of a WeightCache" in explain and "models" in explain and "nodeSelector" in explain
    assert "quantization" in env.cp.kubectl("explain", "wc.spec.models").stdout


def test_operator_restart_midway_converges_without_duplicates(env):
    env.op.kill()
    env.cp.kubectl("scale", "idep", IDEP, "-n", env.ns, "--replicas=1")
    apply(env, inference("second", env.ns, env.pool, replicas=1))
    env.op.start()
    wait(
        env.cp,
        lambda: len(runtime_pods(env)) == 1 and len(runtime_pods(env, "second")) == 1,
        "both InferenceDeployments converge after the restart",
        op=env.op,
    )
    wait(
        env.cp,
        lambda: condition(idep(env, "second"), "Available").get("status") == "True",
        "second Available",
        op=env.op,
    )
    selector = "app.kubernetes.io/name=keepwarm-runtime"
    deployments = items(env.cp, f"/apis/apps/v1/namespaces/{env.ns}/deployments?labelSelector={selector}")
    assert sorted(d["metadata"]["name"] for d in deployments) == ["chat", "second"]
    services = items(env.cp, f"/api/v1/namespaces/{env.ns}/services?labelSelector={selector}")
    assert sorted(s["metadata"]["name"] for s in services) == ["chat", "second"]
    assert len(wcns(env)) == 3
    daemonsets = items(
        env.cp, f"/apis/apps/v1/namespaces/{NAMESPACE}/daemonsets?labelSelector=keepwarm.dev/weightcache={WC}"
    )
    assert len(daemonsets) == 1


def _reconcile_samples(op: OperatorProcess) -> int:
    return len(op.samples(RECONCILES))


def test_peering_standby_idles_then_takes_over(env, tmp_path):
    """kopf peering: a lower-priority replica does nothing while the active one lives, then takes over."""
    standby = OperatorProcess(env.cp, tmp_path, priority=10).start()
    try:
        apply(env, inference("third", env.ns, env.pool, replicas=1))
        wait(
            env.cp,
            lambda: condition(idep(env, "third"), "Available").get("status") == "True",
            "third served",
            op=env.op,
        )
        assert _reconcile_samples(standby) == 0, standby.tail()
        env.op.stop()  # graceful: leaves the peering object at once
        apply(env, inference("fourth", env.ns, env.pool, replicas=1))
        wait(
            env.cp,
            lambda: condition(idep(env, "fourth"), "Available").get("status") == "True",
            "fourth served by the standby",
            op=standby,
        )
        assert _reconcile_samples(standby) > 0
    finally:
        env.op.start()
        standby.stop()
        env.cp.kubectl("delete", "idep", "second", "third", "fourth", "-n", env.ns, check=False)


def test_shrinking_the_node_selector_removes_the_weightcachenode_and_the_cache_returns_to_ready(env):
    cp, name = env.cp, "kwshrink"
    for node in env.nodes[:2]:
        cp.kubectl("label", "node", node, "kw-shrink=in", "--overwrite")
    apply(env, weightcache(name, env.pool))
    wait(cp, lambda: len(wcns(env, name)) == 3, "3 WeightCacheNodes", op=env.op)
    for obj in wcns(env, name):
        patch = json.dumps(agent_status("Resident"))
        cp.kubectl(
            "patch", "wcn", obj["metadata"]["name"], "--subresource=status", "--type=merge", "-p", patch
        )
    wait(cp, lambda: condition(wc(env, name), "Ready").get("status") == "True", "Ready 3/3", op=env.op)
    selector = {"spec": {"nodeSelector": {"pool": env.pool, "kw-shrink": "in"}}}
    cp.kubectl("patch", "wc", name, "--type=merge", "-p", json.dumps(selector))
    wait(
        cp,
        lambda: {o["spec"]["nodeName"] for o in wcns(env, name)} == set(env.nodes[:2]),
        "the unselected node's WeightCacheNode deleted",
        op=env.op,
    )

    def ready_on_two():
        obj = wc(env, name)
        ready = condition(obj, "Ready")
        return ready.get("status") == "True" and obj["status"]["desiredNodes"] == 2 and ready

    ready = wait(cp, ready_on_two, "Ready again on 2 nodes", timeout_s=90, op=env.op)
    assert ready["message"].startswith("2/2")
    assert warm_label_key(name, MODEL) not in get(cp, f"/api/v1/nodes/{env.nodes[2]}")["metadata"]["labels"]
    cp.kubectl("delete", "wc", name)


def test_operator_restart_rebuilds_warm_labels(env):
    """Changes made while no operator runs: a node that lost its model, a label left behind."""
    cp, manager = env.cp, "keepwarm-operator-warm-labels"
    node0, node1 = env.nodes[:2]
    left_behind = warm_label_key("deleted-cache", MODEL)
    env.op.kill()
    try:
        cp.kubectl(
            "patch", "wcn", f"{WC}.{node1}", "--subresource=status", "--type=merge",
            "-p", json.dumps(agent_status("Loading")),
        )  # fmt: skip
        labels = {WARM: "true", left_behind: "true"}
        node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node0, "labels": labels}}
        cp.kubectl(
            "apply", "--server-side", f"--field-manager={manager}", "-f", "-", input=json.dumps(node)
        )  # as if the operator had labelled it for a cache deleted meanwhile
    finally:
        env.op.start()

    def node_labels(name):
        return get(cp, f"/api/v1/nodes/{name}")["metadata"].get("labels", {})

    wait(
        cp,
        lambda: WARM not in node_labels(node1) and left_behind not in node_labels(node0),
        "labels rebuilt from the WeightCacheNodes",
        op=env.op,
    )
    assert node_labels(node0).get(WARM) == "true"
    cp.kubectl(
        "patch", "wcn", f"{WC}.{node1}", "--subresource=status", "--type=merge",
        "-p", json.dumps(agent_status("Resident")),
    )  # fmt: skip
    wait(cp, lambda: node_labels(node1).get(WARM) == "true", "node1 warm again", op=env.op)


def test_stale_heartbeats_and_vanished_nodes(env):
    apply(env, weightcache("kwstale", env.pool, heartbeatSeconds=1))
    wait(
        env.cp,
        lambda: (
            len(wcns(env, "kwstale")) == 3
            and all(o.get("status", {}).get("phase") == "Stale" for o in wcns(env, "kwstale"))
        ),
        "silent agents marked Stale",
        op=env.op,
    )
    wait(
        env.cp,
        lambda: condition(wc(env, "kwstale"), "Degraded").get("reason") == "NodesStale",
        "Degraded",
        op=env.op,
    )
    env.cp.kubectl("delete", "wc", "kwstale")
    gone = env.nodes[2]
    env.cp.remove_node(gone)
    wait(
        env.cp,
        lambda: {o["spec"]["nodeName"] for o in wcns(env)} == set(env.nodes[:2]),
        "the vanished node's WeightCacheNode deleted",
        op=env.op,
    )
    ds_path = f"/apis/apps/v1/namespaces/{NAMESPACE}/daemonsets/keepwarm-agent-{WC}"
    wait(
        env.cp,
        lambda: get(env.cp, ds_path)["status"]["desiredNumberScheduled"] == 2,
        "the DaemonSet controller drops the node",
        timeout_s=180,
    )
    wait(env.cp, lambda: wc(env)["status"]["desiredNodes"] == 2, "desiredNodes 2", op=env.op)
    events = json.loads(
        env.cp.kubectl(
            "get", "events", "-A", "--field-selector", f"involvedObject.name={WC}", "-o", "json"
        ).stdout
    )
    assert {"NodeAdded", "NodeRemoved"} <= {e["reason"] for e in events["items"]}


def test_metrics_count_reconciles(env):
    timer = [s for s in env.op.samples(RECONCILES) if s.labels == {"kind": "WeightCache", "trigger": "timer"}]
    assert timer and timer[0].value > 0
    assert env.op.samples("keepwarm_operator_reconcile_duration_seconds_bucket")


def test_deleting_weightcaches_is_not_held_by_their_resync_timers(env):
    """kopf keeps its finalizer until a WeightCache's timer has stopped; a deletion that lands during a
    reconcile must not wait for kopf's default 60 s re-check (it made `kubectl delete wc` hang)."""
    names = [f"kwdel{i}" for i in range(8)]
    for name in names:  # selecting no node: agents' objects only, no pods
        apply(env, weightcache(name, f"{env.pool}-none"))
    wait(
        env.cp,
        lambda: all((wc(env, n) or {}).get("status", {}).get("observedGeneration") for n in names),
        "caches reconciled",
        op=env.op,
    )
    time.sleep(2.5)  # the 1 s resync timers are running now (initial delay 1 s)
    env.cp.kubectl("delete", "wc", *names, "--wait=false")
    wait(env.cp, lambda: all(wc(env, n) is None for n in names), "caches deleted", timeout_s=30, op=env.op)


def test_delete_garbage_collects_everything(env):
    cp = env.cp
    cp.kubectl("delete", "idep", IDEP, "-n", env.ns, "--wait=false")
    wait(
        cp,
        lambda: (
            get(cp, f"/apis/apps/v1/namespaces/{env.ns}/deployments/{IDEP}") is None
            and get(cp, f"/api/v1/namespaces/{env.ns}/services/{IDEP}") is None
            and not runtime_pods(env)
        ),
        "Deployment, Service and pods collected",
    )
    cp.kubectl("delete", "wc", WC, "--wait=false")
    name = f"keepwarm-agent-{WC}"
    paths = [
        f"/apis/apps/v1/namespaces/{NAMESPACE}/daemonsets/{name}",
        f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/{name}",
        f"/apis/rbac.authorization.k8s.io/v1/clusterroles/{name}",
        f"/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/{name}",
        f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NAMESPACE}/roles/{name}",
        f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NAMESPACE}/rolebindings/{name}",
    ]

    def leftovers() -> list[str]:
        left = [p for p in paths if get(cp, p) is not None] + [o["metadata"]["name"] for o in wcns(env)]
        cache = wc(env)
        if cache is not None:  # still held: say by which finalizers
            left.append(f"WeightCache finalizers={cache['metadata'].get('finalizers')}")
        return left

    try:
        wait(cp, lambda: not leftovers(), "agent objects collected", op=env.op)
    except TimeoutError as exc:
        raise AssertionError(f"left after 60 s: {leftovers()}\n{exc}") from None
    wait(
        cp,
        lambda: all(
            WARM not in get(cp, f"/api/v1/nodes/{n}")["metadata"].get("labels", {}) for n in env.nodes[:2]
        ),
        "warm labels removed",
        op=env.op,
    )
    assert env.op.healthy()
    assert not [e for e in env.op.errors() if "Traceback" in e], env.op.tail()


def test_parallelism_nodes_moves_the_pods_between_a_deployment_and_a_leader_worker_set(env):
    """spec.parallelism.nodes > 1 is a LeaderWorkerSet `<name>-group` (the LWS API without its
    controller here: nothing runs); back to 1, the Deployment returns and the set goes, and again."""
    cp, ns = env.cp, env.ns
    deployment = f"/apis/apps/v1/namespaces/{ns}/deployments/moves"
    group = f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/{ns}/leaderworkersets/moves-group"

    def declare(nodes: int) -> None:
        spec = {"model": {"source": {"path": "/var/lib/models/tiny"}}, "gpusPerPod": 0}
        spec["parallelism"] = {"tensor": 2, "nodes": nodes}
        meta = {"name": "moves", "namespace": ns}
        doc = {"apiVersion": "keepwarm.dev/v1alpha1", "kind": "InferenceDeployment", "metadata": meta}
        result = apply(env, {**doc, "spec": spec}, check=False)
        assert result.returncode == 0, result.stderr

    for nodes, present, gone in ((2, group, deployment), (1, deployment, group), (2, group, deployment)):
        declare(nodes)
        wait(cp, lambda p=present, g=gone: get(cp, p) is not None and get(cp, g) is None, f"nodes {nodes}",
             op=env.op)  # fmt: skip
    lws = get(cp, group)
    assert lws["metadata"]["ownerReferences"][0]["name"] == "moves"
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    cp.kubectl("delete", "-n", ns, "inferencedeployment/moves", "--wait=true")


def test_chart_rbac_grants_exactly_what_the_operator_used(env, request):
    """From the API server's audit log of this module's run: every verb/resource the chart grants the
    operator was used, and the operator was never refused one (the chart grants what the code calls)."""
    here = {item.originalname for item in request.session.items if item.module is request.module}
    if not set(MODULE_TESTS) <= here:
        pytest.skip("needs the traffic of the whole module (run the file, not one test)")
    rules = [r for d in render_chart() if d["kind"] in ("ClusterRole", "Role") for r in d["rules"]]
    env.op.stop()  # flush its last requests; the audit log batches for up to 1 s
    time.sleep(2)
    user = f"system:serviceaccount:{NAMESPACE}:{OPERATOR_SA}"
    allowed, forbidden = used(env.cp.audit_events(user, since=env.started))
    assert not forbidden, f"the operator was refused: {sorted(forbidden)}"
    unused = granted(rules) - allowed - IMPLIED_GRANTS - RACE_ONLY_GRANTS
    assert not unused, f"the chart grants what the operator never used: {sorted(unused)}"
    env.op.start()


MODULE_TESTS = [name for name in dir() if name.startswith("test_")]
