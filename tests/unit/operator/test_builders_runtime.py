"""InferenceDeployment -> Deployment and Service."""

import pytest

from keepwarm_api.inferencedeployment import InferenceDeploymentSpec
from keepwarm_api.paths import LORA_LIST_FILE, LORA_LIST_MOUNT
from keepwarm_api.weightcache import WeightCacheSpec
from keepwarm_operator.builders.meta import warm_label_key
from keepwarm_operator.builders.runtime import (
    CacheBinding,
    lora_list,
    runtime_deployment,
    runtime_service,
    runtime_workload,
    too_few_gpus,
    workload_kind,
)

OWNER = {
    "apiVersion": "keepwarm.dev/v1alpha1",
    "kind": "InferenceDeployment",
    "metadata": {"name": "chat", "uid": "u"},
}
CACHE = WeightCacheSpec.model_validate(
    {
        "models": [{"name": "llama-8b", "source": {"path": "/data/llama"}, "dtype": "float16"}],
        "socket": {"groupId": 3000},
    }
)
BINDING = CacheBinding("wc1", CACHE, CACHE.models[0])


def idep(**overrides):
    return InferenceDeploymentSpec.model_validate(
        {"model": {"cacheRef": "wc1", "name": "llama-8b"}, **overrides}
    )


def test_cached_model_pods_attach_to_the_cache():
    dep = runtime_deployment("chat", "team-a", idep(replicas=3), BINDING, OWNER)
    assert dep["metadata"]["namespace"] == "team-a" and dep["spec"]["replicas"] == 3
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["KEEPWARM_CACHE_SOCKET_DIR"] == "/var/run/keepwarm/wc1"
    assert env["KEEPWARM_CACHE_MODE"] == "zero_copy" and env["KEEPWARM_CACHE_FALLBACK"] == "1"
    sockets = next(v for v in pod["volumes"] if v["name"] == "keepwarm-sockets")
    assert sockets["hostPath"]["path"] == "/var/run/keepwarm/wc1"
    assert pod["securityContext"]["supplementalGroups"] == [3000]
    assert c["command"][:3] == ["keepwarm", "serve", "/models/llama-8b"]
    assert c["command"][c["command"].index("--dtype") + 1] == "float16"  # auto follows the cache
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["command"][c["command"].index("--device") + 1] == "cuda"
    assert c["readinessProbe"]["httpGet"]["path"].startswith("/ready?")
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    # Liveness asks the supervising parent, on the port the command gives it.
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert c["livenessProbe"]["httpGet"]["port"] == "supervisor"
    assert c["command"][c["command"].index("--supervisor-port") + 1] == str(ports["supervisor"])
    assert ports["supervisor"] != ports["http"]
    (pref,) = pod["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert pref["preference"]["matchExpressions"] == [
        {"key": warm_label_key("wc1", "llama-8b"), "operator": "Exists"}
    ]


def test_template_is_stable_and_spec_changes_roll():
    a = runtime_deployment("chat", "ns", idep(), BINDING, OWNER)
    assert a == runtime_deployment("chat", "ns", idep(), BINDING, OWNER)
    b = runtime_deployment("chat", "ns", idep(env=[{"name": "X", "value": "1"}]), BINDING, OWNER)
    assert a["spec"]["template"] != b["spec"]["template"]
    scaled = runtime_deployment("chat", "ns", idep(replicas=5), BINDING, OWNER)
    assert scaled["spec"]["template"] == a["spec"]["template"]


def test_inline_source_without_cache_and_cpu_serving():
    spec = InferenceDeploymentSpec.model_validate(
        {"model": {"source": {"pvc": {"claimName": "models", "subPath": "m"}}}, "gpusPerPod": 0}
    )
    dep = runtime_deployment("chat", "ns", spec, None, OWNER)
    pod = dep["spec"]["template"]["spec"]
    assert "affinity" not in pod
    assert "KEEPWARM_CACHE_SOCKET_DIR" not in {e["name"] for e in pod["containers"][0]["env"]}
    assert pod["volumes"][0]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert pod["containers"][0]["volumeMounts"][0]["subPath"] == "m"
    assert "nvidia.com/gpu" not in pod["containers"][0]["resources"].get("limits", {})
    command = pod["containers"][0]["command"]
    assert "--device" not in command and "--dtype" not in command


def test_no_model_is_an_error():
    spec = InferenceDeploymentSpec.model_validate({"model": {"cacheRef": "x", "name": "y"}})
    with pytest.raises(ValueError, match="cacheRef"):
        runtime_deployment("chat", "ns", spec, None, OWNER)


def test_service_selects_the_pods():
    dep = runtime_deployment("chat", "ns", idep(port=9000), BINDING, OWNER)
    svc = runtime_service("chat", "ns", idep(port=9000), OWNER)
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["ports"] == [{"name": "http", "port": 9000, "targetPort": "http", "protocol": "TCP"}]


def test_warm_label_keys_are_valid_label_keys():
    long = warm_label_key("c" * 40, "m" * 63)
    prefix, name = long.split("/")
    assert prefix == "warm.keepwarm.dev" and len(name) <= 63
    assert warm_label_key("c" * 40, "m" * 63) == long and long != warm_label_key("c" * 40, "n" * 63)


def test_readiness_long_polls_for_its_whole_period_and_no_startup_probe_delays_it():
    """Readiness waits on /ready?wait=N, N its period (the kubelet's timeout longer than N, so it is not
    cut short): a loading pod always has an attempt waiting, so it is Ready when the runtime is. No
    startup probe: the kubelet would start readiness only at its next relist after one succeeds."""
    from urllib.parse import parse_qs, urlsplit

    from keepwarm_api.probes import READY_WAIT_MAX_S, READY_WAIT_PARAM

    dep = runtime_deployment("chat", "ns", idep(), BINDING, OWNER)
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    ready = c["readinessProbe"]
    url = urlsplit(ready["httpGet"]["path"])
    wait = int(parse_qs(url.query)[READY_WAIT_PARAM][0])
    assert url.path == "/ready" and ready["httpGet"]["port"] == "http"
    assert 1 <= wait <= READY_WAIT_MAX_S
    assert ready["periodSeconds"] <= wait < ready["timeoutSeconds"]
    assert "startupProbe" not in c
    # Liveness asks the parent, which binds its port once its imports are done: not before then.
    liveness = c["livenessProbe"]
    assert liveness["httpGet"]["path"] == "/health" and liveness["initialDelaySeconds"] >= 30


def test_startup_timeout_reaches_the_supervising_parent_as_the_worker_load_timeout():
    """With no startup probe, the runtime's parent keeps startupTimeoutSeconds: a worker loading longer
    is restarted as hung (server/supervisor.py). The runtime's own parser reads the rendered command."""
    dep = runtime_deployment("chat", "ns", idep(startupTimeoutSeconds=900), BINDING, OWNER)
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert serve_settings(c["command"]).worker_load_timeout == 900.0


def test_rolling_update_keeps_every_replica_serving():
    dep = runtime_deployment("chat", "ns", idep(replicas=1), BINDING, OWNER)
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0}}


def test_a_deleted_pod_serves_through_its_prestop_sleep_and_the_grace_covers_the_drain():
    """The preStop sleep keeps the pod serving while endpoints drop it; the grace period outlasts the
    sleep, the runtime's drain and the parent's kill of a late worker, so the kubelet's SIGKILL never
    cuts a request short."""
    from keepwarm_api.shutdown import DRAIN_S, PRESTOP_SLEEP_S, STOP_MARGIN_S

    pod = runtime_deployment("chat", "ns", idep(), BINDING, OWNER)["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["lifecycle"] == {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_S}}}
    assert pod["terminationGracePeriodSeconds"] > PRESTOP_SLEEP_S + DRAIN_S + STOP_MARGIN_S


def test_cpu_pods_of_a_host_tier_cache_load_the_nodes_kernel_build_read_only():
    """The folder the node's agent builds the CPU kernel into (test_builders_agent) is mounted read-only
    and named in KEEPWARM_KERNEL_CACHE, where the runtime looks first (engine/attention/native.py);
    GPU pods, and pods of a gpu-tier cache (whose agents build nothing), do not get it."""
    from keepwarm_api.podenv import KERNEL_CACHE
    from keepwarm_operator.builders.agent import agent_daemonset

    host = WeightCacheSpec.model_validate({**CACHE.model_dump(by_alias=True), "tier": "host"})
    binding = CacheBinding("wc1", host, host.models[0])
    pod = runtime_deployment("chat", "ns", idep(gpusPerPod=0), binding, OWNER)["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == env[KERNEL_CACHE]]
    assert mount["readOnly"] is True
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    agent = agent_daemonset("wc1", host, "ns", None)["spec"]["template"]["spec"]
    (built,) = [v for v in agent["volumes"] if v["name"] == volume["name"]]
    assert volume == built  # the same node folder the agent's init container writes
    (init,) = agent["initContainers"]
    written = {e["name"]: e["value"] for e in init["env"]}["TORCH_EXTENSIONS_DIR"]
    assert written == env[KERNEL_CACHE]  # and at the same path inside both pods

    for spec_, cache in ((idep(), binding), (idep(gpusPerPod=0), BINDING)):
        pod = runtime_deployment("chat", "ns", spec_, cache, OWNER)["spec"]["template"]["spec"]
        assert KERNEL_CACHE not in {e["name"] for e in pod["containers"][0]["env"]}
        assert volume["name"] not in {v["name"] for v in pod["volumes"]}


LORA = {
    "maxLoras": 2,
    "maxLoraRank": 16,
    "adapters": [
        {"name": "sql", "source": {"pvc": {"claimName": "adapters", "subPath": "sql-r16"}}},
        {"name": "chat-de", "source": {"containerPath": "/opt/adapters/chat-de"}},
    ],
}


def serve_settings(command: list[str]):
    """The settings `keepwarm serve` resolves from a rendered command, by the runtime's own parser."""
    import argparse

    from keepwarm_runtime.server import cli

    assert command[:2] == ["keepwarm", "serve"]
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    return cli.serve_settings(parser.parse_args(command[1:]))


def served_list(spec: InferenceDeploymentSpec, binding: CacheBinding | None) -> dict[str, str]:
    """Adapter -> directory, as the runtime reads the operator's ConfigMap (its --lora-modules-file)."""
    from keepwarm_runtime.server.base.lora_modules import parse_lora_modules_file

    listing = lora_list("chat", "ns", spec, binding, OWNER)
    assert listing is not None and listing["metadata"]["name"] == "chat-lora"
    assert listing["metadata"]["ownerReferences"][0]["uid"] == OWNER["metadata"]["uid"]
    return {m.name: m.path for m in parse_lora_modules_file(listing["data"][LORA_LIST_FILE], "list")}


def test_lora_adapters_reach_the_runtime_through_its_mounted_list():
    dep = runtime_deployment("chat", "ns", idep(lora=LORA), BINDING, OWNER)
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    settings = serve_settings(c["command"])
    assert (settings.enable_lora, settings.max_loras, settings.max_lora_rank) == (True, 2, 16)
    assert settings.lora_modules == () and settings.lora_modules_file == f"{LORA_LIST_MOUNT}/{LORA_LIST_FILE}"
    assert served_list(idep(lora=LORA), BINDING) == {"sql": "/lora/sql", "chat-de": "/opt/adapters/chat-de"}
    assert settings.allow_runtime_lora_updating is False
    assert settings.served_model_name == "llama-8b"
    listing = next(v for v in pod["volumes"] if v.get("configMap"))
    assert listing["configMap"] == {"name": "chat-lora"}
    mount = next(m for m in c["volumeMounts"] if m["name"] == listing["name"])
    assert mount == {"name": listing["name"], "mountPath": LORA_LIST_MOUNT, "readOnly": True}
    # The pvc adapter is mounted read-only where its list entry points; the containerPath one needs no volume.
    volume = next(v for v in pod["volumes"] if v["name"] == "lora-sql")
    assert volume["persistentVolumeClaim"] == {"claimName": "adapters", "readOnly": True}
    mount = next(m for m in c["volumeMounts"] if m["name"] == "lora-sql")
    assert mount == {"name": "lora-sql", "mountPath": "/lora/sql", "readOnly": True, "subPath": "sql-r16"}
    assert not any(v["name"].startswith("lora-chat") for v in pod["volumes"])


def test_an_adapter_named_list_keeps_its_own_volume():
    lora = {"adapters": [{"name": "list", "source": {"pvc": {"claimName": "adapters"}}}]}
    pod = runtime_deployment("chat", "ns", idep(lora=lora), BINDING, OWNER)["spec"]["template"]["spec"]
    names = [v["name"] for v in pod["volumes"]]
    assert len(names) == len(set(names)) and "lora-list" in names


def test_lora_bounds_left_unset_keep_the_runtimes_defaults_and_updating_is_opt_in():
    lora = {"allowRuntimeUpdating": True}
    (c,) = runtime_deployment("chat", "ns", idep(lora=lora), BINDING, OWNER)["spec"]["template"]["spec"][
        "containers"
    ]
    settings = serve_settings(c["command"])
    assert settings.enable_lora is True and settings.allow_runtime_lora_updating is True
    assert (settings.max_loras, settings.max_lora_rank) == (None, None)
    assert served_list(idep(lora=lora), BINDING) == {}


def test_lora_disabled_or_absent_renders_nothing():
    plain = runtime_deployment("chat", "ns", idep(), BINDING, OWNER)
    off = runtime_deployment("chat", "ns", idep(lora={**LORA, "enabled": False}), BINDING, OWNER)
    assert off == plain
    assert "--enable-lora" not in plain["spec"]["template"]["spec"]["containers"][0]["command"]
    assert serve_settings(plain["spec"]["template"]["spec"]["containers"][0]["command"]).enable_lora is None
    assert lora_list("chat", "ns", idep(), BINDING, OWNER) is None
    assert lora_list("chat", "ns", idep(lora={**LORA, "enabled": False}), BINDING, OWNER) is None


CACHE_WITH_ADAPTERS = WeightCacheSpec.model_validate(
    {
        "modelDirectory": "/data",
        "models": [
            {
                "name": "llama-8b",
                "source": {"path": "/data/llama"},
                "adapters": [
                    {"name": "sql", "source": {"path": "/data/adapters/sql"}},
                    {"name": "de", "source": {"pvc": {"claimName": "adapters", "subPath": "de"}}},
                    {"name": "fr", "source": {"huggingFace": {"repo": "org/fr-lora", "revision": "abc123"}}},
                ],
            }
        ],
    }
)
CACHED_BINDING = CacheBinding("wc1", CACHE_WITH_ADAPTERS, CACHE_WITH_ADAPTERS.models[0])


def test_cached_adapters_are_read_where_the_agent_reads_them():
    """source.cached: a path adapter in the cache's modelDirectory (mounted once, as in agent pods), a
    claim the same claim, a Hub adapter the snapshot in the node's download directory (mounted although
    the model is a path)."""
    lora = {
        "adapters": [
            {"name": n, "source": {"cached": c}} for n, c in (("text-sql", "sql"), ("de", "de"), ("fr", "fr"))
        ]
    }
    pod = runtime_deployment("chat", "ns", idep(lora=lora), CACHED_BINDING, OWNER)["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert served_list(idep(lora=lora), CACHED_BINDING) == {
        "text-sql": "/host-models/adapters/sql",
        "de": "/lora/de",
        "fr": "/var/cache/keepwarm/huggingface/models--org--fr-lora/snapshots/abc123",
    }
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["host-models"]["hostPath"] == {"path": "/data", "type": "DirectoryOrCreate"}
    assert volumes["lora-de"]["persistentVolumeClaim"] == {"claimName": "adapters", "readOnly": True}
    assert volumes["hf-cache"]["hostPath"]["path"] == "/var/cache/keepwarm"
    assert "lora-text-sql" not in volumes and "lora-fr" not in volumes
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["lora-de"]["subPath"] == "de"
    assert mounts["host-models"] == {"name": "host-models", "mountPath": "/host-models", "readOnly": True}
    assert mounts["hf-cache"]["readOnly"] is True


def test_changing_adapters_not_on_a_claim_rolls_no_pod():
    """Cached path and Hub adapters and containerPaths need no volume of their own: a new list is a new
    ConfigMap, the pod template stays (running pods follow the file). A claim is a pod volume, so
    adding or removing an adapter on a claim rolls the pods."""
    kinds = {
        "text-sql": {"cached": "sql"},
        "fr": {"cached": "fr"},
        "baked": {"containerPath": "/opt/adapters/baked"},
        "de": {"pvc": {"claimName": "adapters", "subPath": "de"}},
    }

    def render(names: list[str]) -> tuple[dict, dict[str, str]]:
        spec = idep(lora={"adapters": [{"name": n, "source": kinds[n]} for n in names]})
        return runtime_deployment("chat", "ns", spec, CACHED_BINDING, OWNER)["spec"]["template"], served_list(
            spec, CACHED_BINDING
        )

    none, listed_none = render([])
    some, listed_some = render(["text-sql", "baked"])
    other, listed_other = render(["fr"])
    assert none == some == other
    assert listed_none == {} and set(listed_some) == {"text-sql", "baked"} and set(listed_other) == {"fr"}
    with_claim, _ = render(["fr", "de"])
    assert with_claim != other


def test_a_cached_adapter_the_cache_does_not_list_is_named():
    from keepwarm_operator.builders.runtime import missing_cached_adapters

    lora = {
        "adapters": [{"name": "a", "source": {"cached": "sql"}}, {"name": "b", "source": {"cached": "nope"}}]
    }
    spec = idep(lora=lora)
    assert missing_cached_adapters(spec.lora, CACHE_WITH_ADAPTERS.models[0]) == ["nope"]
    with pytest.raises(ValueError, match="no cached adapter 'nope'"):
        runtime_deployment("chat", "ns", spec, CACHED_BINDING, OWNER)
    assert missing_cached_adapters(idep(lora={**lora, "enabled": False}).lora, CACHE.models[0]) == []


def test_a_tensor_parallel_pod_takes_a_gpu_per_rank_its_flags_and_shared_memory():
    spec = idep(parallelism={"tensor": 4, "expert": True})
    pod = runtime_deployment("chat", "ns", spec, BINDING, OWNER)["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 4
    settings = serve_settings(c["command"])  # the runtime's own parser reads what was rendered
    assert settings.tensor_parallel_size == 4 and settings.enable_expert_parallel
    shm = next(v for v in pod["volumes"] if v["name"] == "keepwarm-shm")
    assert shm == {"name": "keepwarm-shm", "emptyDir": {"medium": "Memory"}}
    assert {"name": "keepwarm-shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    one = runtime_deployment("chat", "ns", idep(), BINDING, OWNER)["spec"]["template"]["spec"]
    assert "--tensor-parallel-size" not in one["containers"][0]["command"]
    assert all(v["name"] != "keepwarm-shm" for v in one["volumes"])
    cpu = runtime_deployment("chat", "ns", idep(parallelism={"tensor": 2}, gpusPerPod=0), BINDING, OWNER)
    (c,) = cpu["spec"]["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
    assert serve_settings(c["command"]).tensor_parallel_size == 2


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"parallelism": {"tensor": 4}, "gpusPerPod": 2}, "a pod takes one GPU per rank"),
        ({"parallelism": {"expert": True}}, "parallelism.expert needs parallelism.tensor > 1"),
        ({"parallelism": {"tensor": 4, "nodes": 3}}, "parallelism.nodes 3 must divide parallelism.tensor 4"),
        (
            {"parallelism": {"tensor": 4, "nodes": 2}, "gpusPerPod": 4},
            "takes one GPU per rank: gpusPerPod is 0",
        ),
        (
            {"parallelism": {"tensor": 2}, "lora": {"adapters": []}},
            "LoRA adapters are served on one rank only",
        ),
    ],
)
def test_parallelism_that_cannot_work_is_refused_by_name(overrides, message):
    with pytest.raises(ValueError, match=message):
        idep(**overrides)


def test_a_group_larger_than_every_nodes_gpus_is_refused_naming_the_largest():
    def node(name, gpus):
        return {"metadata": {"name": name}, "status": {"allocatable": {"nvidia.com/gpu": str(gpus)}}}

    spec = idep(parallelism={"tensor": 8})
    assert too_few_gpus(spec, [node("a", 8), node("b", 4)]) is None
    refusal = too_few_gpus(spec, [node("b", 4), node("a", 4), node("c", 0)])
    assert (
        refusal.startswith("parallelism.tensor 8 needs 8 GPUs in one pod") and "the most: 4, on a" in refusal
    )
    assert too_few_gpus(spec, [node("cpu", 0)]) is None  # no GPU node to judge by (an autoscaler adds them)
    assert too_few_gpus(idep(parallelism={"tensor": 8}, gpusPerPod=0), [node("b", 4)]) is None  # CPU ranks


SNAPSHOT_CACHE = WeightCacheSpec.model_validate(
    {**CACHE.wire(), "snapshots": {"enabled": True, "directory": "/srv/snapshots", "budget": "8Gi"}}
)


def test_snapshot_startup_mounts_the_store_read_only_and_gives_only_what_a_restore_needs():
    spec = idep(startup={"mode": "Snapshot", "restoreTimeoutSeconds": 12})
    dep = runtime_deployment(
        "chat", "team-a", spec, CacheBinding("wc1", SNAPSHOT_CACHE, SNAPSHOT_CACHE.models[0]), OWNER
    )
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    store = next(v for v in pod["volumes"] if v["name"] == "keepwarm-snapshots")
    assert store["hostPath"]["path"] == "/srv/snapshots/wc1"
    assert {"name": "keepwarm-snapshots", "mountPath": "/var/lib/keepwarm/snapshots", "readOnly": True} in c[
        "volumeMounts"
    ]
    assert c["securityContext"] == {
        "allowPrivilegeEscalation": True,
        "capabilities": {"drop": ["ALL"], "add": ["CHECKPOINT_RESTORE", "SETPCAP"]},
        "seccompProfile": {"type": "Unconfined"},  # RuntimeDefault answers clone3 with ENOSYS
    }
    settings = serve_settings(c["command"])  # the runtime's own parser reads what was rendered
    assert settings.snapshot_store == "/var/lib/keepwarm/snapshots" and settings.restore_timeout == 12
    assert settings.cache_socket_dir is None  # the socket directory comes in the environment
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["KEEPWARM_CACHE_SOCKET_DIR"] == "/var/run/keepwarm/wc1"  # where the agent takes requests


def test_import_startup_keeps_the_container_unprivileged():
    (c,) = runtime_deployment("chat", "ns", idep(), BINDING, OWNER)["spec"]["template"]["spec"]["containers"]
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    assert "--snapshot-store" not in c["command"]


@pytest.mark.parametrize(
    ("binding", "said"),
    [(None, "set spec.model.cacheRef"), (BINDING, "WeightCache 'wc1' does not enable spec.snapshots")],
)
def test_snapshot_startup_without_a_store_is_refused_by_name(binding, said):
    from keepwarm_operator.builders.runtime import snapshot_refusal

    spec = idep(startup={"mode": "Snapshot"})
    assert said in snapshot_refusal(spec, binding)
    with pytest.raises(ValueError, match=r"spec\.startup\.mode Snapshot"):
        runtime_deployment("chat", "ns", spec, binding, OWNER)


def _expanded(command: list[str], env: dict[str, str]) -> list[str]:
    """The command as the kubelet runs it: $(VAR) replaced from the container's environment."""
    for name, value in env.items():
        command = [part.replace(f"$({name})", value) for part in command]
    return command


def test_a_group_over_pods_is_a_leader_worker_set_whose_leaders_alone_serve():
    spec = idep(parallelism={"tensor": 4, "nodes": 2, "expert": True}, replicas=3)
    lws = runtime_workload("chat", "ns", spec, BINDING, OWNER)
    assert (
        (lws["apiVersion"], lws["kind"])
        == workload_kind(spec)
        == ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")
    )
    assert lws["metadata"]["ownerReferences"][0]["name"] == "chat" and lws["spec"]["replicas"] == 3
    assert lws["metadata"]["name"] == "chat-group"  # LWS's headless Service takes its name: not the Service's
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2 and group["restartPolicy"] == "RecreateGroupOnPodRestart"
    env = {"LWS_LEADER_ADDRESS": "chat-group-0.chat-group.ns", "LWS_WORKER_INDEX": "1"}
    (leader,) = group["leaderTemplate"]["spec"]["containers"]
    (worker,) = group["workerTemplate"]["spec"]["containers"]
    for c, rank in ((leader, 0), (worker, 1)):
        settings = serve_settings(_expanded(c["command"], env))  # the runtime's own parser reads it
        assert (settings.tensor_parallel_size, settings.nnodes, settings.node_rank) == (4, 2, rank)
        assert settings.master_addr == "chat-group-0.chat-group.ns" and settings.enable_expert_parallel
        assert settings.headless == (rank == 1)
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 2  # its share of the ranks, one GPU each
    assert {p["name"] for p in worker["ports"]} == {"supervisor"}  # no API on a worker
    assert worker["readinessProbe"]["httpGet"]["port"] == "supervisor"
    assert leader["readinessProbe"]["httpGet"]["port"] == "http"
    service = runtime_service("chat", "ns", spec, OWNER)
    assert service["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    one = idep(parallelism={"tensor": 4})
    assert runtime_workload("chat", "ns", one, BINDING, OWNER) == runtime_deployment(
        "chat", "ns", one, BINDING, OWNER
    )
    assert (
        "leaderworkerset.sigs.k8s.io/worker-index"
        not in runtime_service("chat", "ns", one, OWNER)["spec"]["selector"]
    )


def test_a_group_over_pods_needs_only_its_share_of_gpus_on_a_node():
    def node(name, gpus):
        return {"metadata": {"name": name}, "status": {"allocatable": {"nvidia.com/gpu": str(gpus)}}}

    assert too_few_gpus(idep(parallelism={"tensor": 16, "nodes": 2}), [node("a", 8)]) is None
    refusal = too_few_gpus(idep(parallelism={"tensor": 16}), [node("a", 8)])
    assert refusal is not None and "parallelism.nodes" in refusal
