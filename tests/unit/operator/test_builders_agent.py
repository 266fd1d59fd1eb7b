"""WeightCache -> agent DaemonSet and RBAC."""

from keepwarm_api.weightcache import WeightCacheSpec
from keepwarm_operator.builders.agent import agent_children, agent_daemonset, agent_rbac

OWNER = {
    "apiVersion": "keepwarm.dev/v1alpha1",
    "kind": "WeightCache",
    "metadata": {"name": "llama", "uid": "u-1"},
}


def spec(**overrides):
    base = {"models": [{"name": "llama-8b", "source": {"path": "/data/llama"}}], **overrides}
    return WeightCacheSpec.model_validate(base)


def test_daemonset_runs_agent_with_report_flags_and_socket_dir():
    ds = agent_daemonset("llama", spec(), "keepwarm-system", OWNER)
    assert ds["metadata"]["namespace"] == "keepwarm-system"
    assert ds["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    pod = ds["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    cmd = container["command"]
    assert cmd[:3] == ["keepwarm", "cache", "serve"]
    i = cmd.index("--report-to-kubernetes")
    assert cmd[i:] == ["--report-to-kubernetes", "--weightcache", "llama", "--node-name", "$(NODE_NAME)"]
    assert cmd[cmd.index("--socket-dir") + 1] == "/var/run/keepwarm/llama"
    assert cmd[cmd.index("--group") + 1] == "2000" and cmd[cmd.index("--dtype") + 1] == "bfloat16"
    sockets = next(v for v in pod["volumes"] if v["name"] == "sockets")
    assert sockets["hostPath"] == {"path": "/var/run/keepwarm/llama", "type": "DirectoryOrCreate"}
    model = next(v for v in pod["volumes"] if v["name"] == "model-llama-8b")
    assert model["hostPath"]["path"] == "/data/llama"
    assert {"name": "model-llama-8b", "mountPath": "/models/llama-8b", "readOnly": True} in container[
        "volumeMounts"
    ]
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert pod["securityContext"]["runAsGroup"] == 2000
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    assert pod["serviceAccountName"] == "keepwarm-agent-llama"
    assert (
        ds["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    )


def test_gpu_access_without_claiming_gpus():
    gpu = agent_daemonset("llama", spec(tier="gpu"), "ns", OWNER)["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in gpu["containers"][0]["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert gpu["runtimeClassName"] == "nvidia"
    assert "nvidia.com/gpu" not in str(gpu["containers"][0].get("resources", {}))
    host = agent_daemonset("llama", spec(tier="host"), "ns", OWNER)["spec"]["template"]["spec"]
    assert "runtimeClassName" not in host
    assert "NVIDIA_VISIBLE_DEVICES" not in {e["name"] for e in host["containers"][0]["env"]}
    custom = spec(tier="gpu", agent={"gpuAccess": {"runtimeClassName": None}})
    assert "runtimeClassName" not in agent_daemonset("x", custom, "ns", OWNER)["spec"]["template"]["spec"]


def test_node_selector_tolerations_budget_and_hf_token():
    s = spec(
        nodeSelector={"nvidia.com/gpu.present": "true"},
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        budget="40Gi",
        models=[
            {
                "name": "gated",
                "source": {
                    "huggingFace": {"repo": "org/m", "revision": "abc", "tokenSecretRef": {"name": "hf"}}
                },
            }
        ],
    )
    pod = agent_daemonset("c", s, "ns", OWNER)["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    container = pod["containers"][0]
    assert container["command"][container["command"].index("--budget") + 1] == str(40 * 2**30)
    env = {e["name"]: e for e in container["env"]}
    assert env["KEEPWARM_HF_TOKEN_GATED"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
    assert any(v["name"] == "hf-cache" for v in pod["volumes"])


def test_agent_rbac_is_least_privilege():
    sa, role, binding = agent_rbac("llama", "keepwarm-system", OWNER)
    assert sa["kind"] == "ServiceAccount" and sa["metadata"]["namespace"] == "keepwarm-system"
    verbs = {
        (tuple(r["resources"]), tuple(r.get("resourceNames", ()))): set(r["verbs"]) for r in role["rules"]
    }
    assert verbs == {
        (("weightcaches",), ("llama",)): {"get"},
        (("weightcachenodes/status",), ()): {"patch"},
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "keepwarm-agent-llama", "namespace": "keepwarm-system"}
    ]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]


def test_children_order_rbac_before_pods():
    kinds = [c["kind"] for c in agent_children("llama", spec(), "ns", OWNER)]
    assert kinds == ["ServiceAccount", "ClusterRole", "ClusterRoleBinding", "DaemonSet"]


def test_private_socket_mode_drops_group():
    cmd = agent_daemonset("c", spec(socket={"mode": "0700"}), "ns", OWNER)["spec"]["template"]["spec"]
    assert "--group" not in cmd["containers"][0]["command"]


def test_agent_is_ready_only_when_its_daemon_answers():
    (container,) = agent_daemonset("llama", spec(), "ns", OWNER)["spec"]["template"]["spec"]["containers"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/metrics", "port": "metrics"}
    assert container["ports"] == [{"name": "metrics", "containerPort": spec().agent.metrics_port}]
