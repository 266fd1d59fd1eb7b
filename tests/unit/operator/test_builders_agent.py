"""WeightCache -> agent DaemonSet and RBAC."""

import hashlib
import json

from keepwarm_api.weightcache import WeightCacheSpec
from keepwarm_operator.builders.agent import agent_children, agent_daemonset, agent_rbac, token_secrets

OWNER = {
    "apiVersion": "keepwarm.dev/v1alpha1",
    "kind": "WeightCache",
    "metadata": {"name": "llama", "uid": "u-1"},
}


def spec(**overrides):
    base = {"models": [{"name": "llama-8b", "source": {"path": "/var/lib/models/llama"}}], **overrides}
    return WeightCacheSpec.model_validate(base)


def test_daemonset_runs_agent_with_report_flags_and_socket_dir():
    ds = agent_daemonset("llama", spec(), "keepwarm-system", OWNER)
    assert ds["metadata"]["namespace"] == "keepwarm-system"
    assert ds["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    pod = ds["spec"]["template"]["spec"]
    container, _holder = pod["containers"]
    cmd = container["command"]
    assert cmd[:3] == ["keepwarm", "cache", "serve"]
    i = cmd.index("--report-to-kubernetes")
    assert cmd[i:] == ["--report-to-kubernetes", "--weightcache", "llama", "--node-name", "$(NODE_NAME)"]
    assert cmd[cmd.index("--socket-dir") + 1] == "/var/run/keepwarm/llama"
    assert cmd[cmd.index("--group") + 1] == "2000" and cmd[cmd.index("--dtype") + 1] == "bfloat16"
    sockets = next(v for v in pod["volumes"] if v["name"] == "sockets")
    assert sockets["hostPath"] == {"path": "/var/run/keepwarm/llama", "type": "DirectoryOrCreate"}
    models = next(v for v in pod["volumes"] if v["name"] == "host-models")
    assert models["hostPath"]["path"] == "/var/lib/models"  # modelDirectory, not the model's own path
    assert {"name": "host-models", "mountPath": "/host-models", "readOnly": True} in container["volumeMounts"]
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
    # One daemon per GPU on the gpu tier (a pod attaches its own GPU's socket); the host tier has one.
    assert "--all-gpus" in gpu["containers"][0]["command"]
    assert "--all-gpus" not in host["containers"][0]["command"]
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
    assert "secretKeyRef" not in json.dumps(container["env"])  # the agent reads its tokens via the API
    assert any(v["name"] == "hf-cache" for v in pod["volumes"])
    assert token_secrets(s) == ["hf"]


def _template_hash(s: WeightCacheSpec) -> str:
    template = agent_daemonset("c", s, "ns", OWNER)["spec"]["template"]
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()


def test_models_change_no_pod_template_except_pvc_sources():
    one = spec()
    more = spec(
        models=[
            *[m.wire() for m in one.models],
            {"name": "other", "source": {"path": "/var/lib/models/other"}, "pin": True},
            {
                "name": "hub",
                "source": {
                    "huggingFace": {"repo": "o/r", "revision": "main", "tokenSecretRef": {"name": "t"}}
                },
            },
        ]
    )
    assert _template_hash(more) == _template_hash(one) == _template_hash(spec(models=[]))
    claim = spec(models=[{"name": "p", "source": {"pvc": {"claimName": "weights"}}}])
    assert _template_hash(claim) != _template_hash(one)  # a claim can only be mounted by the pod spec


def test_agent_rbac_is_least_privilege():
    sa, role, binding, secrets, secrets_binding = agent_rbac("llama", "keepwarm-system", OWNER, ["hf"])
    assert sa["kind"] == "ServiceAccount" and sa["metadata"]["namespace"] == "keepwarm-system"
    verbs = {
        (tuple(r["resources"]), tuple(r.get("resourceNames", ()))): set(r["verbs"]) for r in role["rules"]
    }
    assert verbs == {
        (("weightcachenodes",), ()): {"list", "watch"},
        (("weightcachenodes/status",), ()): {"patch"},
    }
    assert secrets["kind"] == "Role" and secrets["metadata"]["namespace"] == "keepwarm-system"
    lease = {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create", "patch"]}
    assert secrets["rules"] == [
        lease,
        {"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["hf"], "verbs": ["get"]},
    ]
    for b, r in ((binding, role), (secrets_binding, secrets)):
        assert b["subjects"] == [
            {"kind": "ServiceAccount", "name": "keepwarm-agent-llama", "namespace": "keepwarm-system"}
        ]
        assert (b["roleRef"]["kind"], b["roleRef"]["name"]) == (r["kind"], r["metadata"]["name"])
    # No token: no Secret rule at all (an empty resourceNames would grant every Secret).
    assert agent_rbac("llama", "keepwarm-system", OWNER)[3]["rules"] == [lease]


def test_children_order_rbac_before_pods():
    kinds = [c["kind"] for c in agent_children("llama", spec(), "ns", OWNER)]
    assert kinds == [
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "DaemonSet",
    ]


def test_private_socket_mode_drops_group():
    cmd = agent_daemonset("c", spec(socket={"mode": "0700"}), "ns", OWNER)["spec"]["template"]["spec"]
    assert "--group" not in cmd["containers"][0]["command"]


def test_agent_is_ready_only_when_its_daemon_answers():
    container, _holder = agent_daemonset("llama", spec(), "ns", OWNER)["spec"]["template"]["spec"][
        "containers"
    ]
    assert container["readinessProbe"]["httpGet"] == {"path": "/metrics", "port": "metrics"}
    assert container["ports"] == [{"name": "metrics", "containerPort": spec().agent.metrics_port}]


def test_upgrades_surge_and_the_old_pod_hands_over():
    """maxSurge 1 / maxUnavailable 0: the new pod runs beside the old one on each node and takes its
    daemon's arenas, socket and lock over; the old one then idles (an exited container would be
    restarted by the kubelet and take everything back)."""
    ds = agent_daemonset("llama", spec(), "ns", OWNER)
    assert ds["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    agent, holder = ds["spec"]["template"]["spec"]["containers"]
    cmd = agent["command"]
    assert cmd[cmd.index("--after-handoff") + 1] == "wait"
    assert holder["name"] == "holder"
    assert holder["command"] == [
        "keepwarm", "cache", "hold", "--socket-dir", "/var/run/keepwarm/llama",
        "--after-handoff", "wait", "--group", "2000",
    ]  # fmt: skip
    assert holder["image"] == agent["image"]
    assert {"name": "sockets", "mountPath": "/var/run/keepwarm/llama"} in holder["volumeMounts"]
    assert holder["securityContext"] == agent["securityContext"]


def test_the_rendered_commands_parse_as_the_runtime_declares_them():
    """The flags the builder writes are the ones `keepwarm cache serve` and `hold` accept."""
    import argparse

    from keepwarm_runtime.cache.cli import register

    parser = argparse.ArgumentParser(prog="keepwarm")
    register(parser.add_subparsers(dest="command"))
    agent, holder = agent_daemonset("llama", spec(), "ns", OWNER)["spec"]["template"]["spec"]["containers"]
    for command in (agent["command"], holder["command"]):
        args = parser.parse_args(command[1:])
        assert args.after_handoff == "wait" and args.socket_dir == "/var/run/keepwarm/llama"


def test_shared_socket_group_is_served_not_only_reachable():
    """Pods with groupId as a supplemental group reach the 0770 socket; the daemon must also allow
    them (it serves only its own uid plus --allow-uid/--allow-gid): found running the DaemonSet for
    real, where every runtime pod fell back to disk ("uid 10001 with gids [2000, 10001] is not
    allowed")."""

    def allowed(**socket):
        cmd = agent_daemonset("llama", spec(socket=socket), "ns", OWNER)["spec"]["template"]["spec"]
        command = cmd["containers"][0]["command"]
        return [command[i + 1] for i, arg in enumerate(command) if arg == "--allow-gid"]

    assert allowed() == ["2000"]
    assert allowed(groupId=3000) == ["3000"]
    assert allowed(groupId=3000, allowedGids=[3000, 4000]) == ["3000", "4000"]
    assert allowed(allowedUids=[10001]) == []  # only those uids, as the spec says
    assert allowed(mode="0700") == []


def test_host_tier_agents_build_the_cpu_kernel_into_the_nodes_kernel_folder():
    """The init container writes the node's kernel folder (a hostPath under the download directory);
    the gpu tier, whose pods do not run the CPU kernel, builds nothing."""
    from keepwarm_operator.builders.agent import KERNEL_BUILD
    from keepwarm_runtime.engine.attention import native

    pod = agent_daemonset("llama", spec(tier="host", downloadDirectory="/data/kw"), "ns", OWNER)
    pod = pod["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["command"] == KERNEL_BUILD and init["image"] == pod["containers"][0]["image"]
    assert native.__name__ == KERNEL_BUILD[2] and native.parser().parse_args(KERNEL_BUILD[3:]).optional
    env = {e["name"]: e["value"] for e in init["env"]}
    (mount,) = [m for m in init["volumeMounts"] if m["mountPath"] == env["TORCH_EXTENSIONS_DIR"]]
    assert mount.get("readOnly") is not True
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["hostPath"] == {"path": "/data/kw/kernels", "type": "DirectoryOrCreate"}
    assert init["securityContext"]["readOnlyRootFilesystem"] is True  # the build goes to the mounts only
    assert {m["mountPath"] for m in init["volumeMounts"]} == {env["TORCH_EXTENSIONS_DIR"], env["HOME"]}

    gpu = agent_daemonset("llama", spec(), "ns", OWNER)["spec"]["template"]["spec"]
    assert "initContainers" not in gpu and all(
        "kernels" not in v["hostPath"]["path"] for v in gpu["volumes"] if "hostPath" in v
    )


def test_a_hub_mirror_reaches_the_agent_as_hf_endpoint():
    def env(s):
        (container, _holder) = agent_daemonset("llama", s, "ns", OWNER)["spec"]["template"]["spec"][
            "containers"
        ]
        return {e["name"]: e.get("value") for e in container["env"]}

    mirror = spec(agent={"huggingFaceEndpoint": "http://hub-mirror.ml.svc:8090"})
    assert env(mirror)["HF_ENDPOINT"] == "http://hub-mirror.ml.svc:8090"
    assert "HF_ENDPOINT" not in env(spec())  # huggingface_hub's own default: huggingface.co


def test_snapshot_agents_write_the_store_with_the_capabilities_of_a_take_and_the_holder_gets_none():
    import argparse

    from keepwarm_runtime.cache.cli import register

    s = spec(snapshots={"enabled": True, "directory": "/srv/snapshots", "budget": "1Gi"})
    pod = agent_daemonset("llama", s, "ns", OWNER)["spec"]["template"]["spec"]
    agent, holder = pod["containers"]
    store = next(v for v in pod["volumes"] if v["name"] == "snapshots")
    assert store["hostPath"] == {"path": "/srv/snapshots/llama", "type": "DirectoryOrCreate"}
    assert {"name": "snapshots", "mountPath": "/var/lib/keepwarm/snapshots"} in agent["volumeMounts"]
    assert agent["securityContext"]["capabilities"]["add"] == [
        "CHOWN", "FOWNER", "SETUID", "SETGID", "SETPCAP", "CHECKPOINT_RESTORE",
    ]  # fmt: skip
    assert agent["securityContext"]["allowPrivilegeEscalation"] is False
    assert agent["securityContext"]["seccompProfile"] == {"type": "Unconfined"}  # CRIU: no filtered dumps
    assert holder["securityContext"]["capabilities"]["add"] == ["CHOWN", "FOWNER"]
    assert "seccompProfile" not in holder["securityContext"]
    parser = argparse.ArgumentParser(prog="keepwarm")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(agent["command"][1:])
    assert args.snapshot_store == "/var/lib/keepwarm/snapshots" and args.snapshot_budget == 1 << 30
    plain = agent_daemonset("llama", spec(), "ns", OWNER)["spec"]["template"]["spec"]
    assert "--snapshot-store" not in plain["containers"][0]["command"]
    assert plain["containers"][0]["securityContext"]["capabilities"]["add"] == ["CHOWN", "FOWNER"]
    assert "seccompProfile" not in plain["containers"][0]["securityContext"]
