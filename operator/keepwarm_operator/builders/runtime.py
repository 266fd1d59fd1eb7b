"""InferenceDeployment -> Deployment + Service of runtime pods (`keepwarm serve`), and the ConfigMap
listing their LoRA adapters; a group of ranks over several pods (spec.parallelism.nodes) is a
LeaderWorkerSet instead of the Deployment, its leaders behind the Service.

Warm-node preference is a preferred node affinity on a node label the operator maintains
(warm.keepwarm.dev/<cache>.<model>), not a list of node names: the pod template then stays the same
when nodes warm up or cool down, so cache changes never roll the pods.

A pod of parallelism.tensor N runs N ranks (`--tensor-parallel-size N`, and `--enable-expert-parallel`),
or its share N / nodes of them, requests one GPU per rank on GPUs, and gets a memory-backed /dev/shm
for them.

CPU pods of a host-tier cache mount the node's kernel folder read-only and name it in
KEEPWARM_KERNEL_CACHE: the CPU attention kernel the node's agent built loads in milliseconds instead of
being compiled by every fresh pod (builders/agent.py).

With spec.startup.mode Snapshot (docs/snapshots.md) the pods mount the cache's snapshot store
read-only, `keepwarm serve` gets --snapshot-store, and the runtime container what a restore costs:
CHECKPOINT_RESTORE and SETPCAP in its bounding set, privilege escalation allowed, so that the
file capabilities of the image's criu take effect (the server itself runs with none), and a seccomp
profile that lets CRIU recreate pids (clone3).

LoRA adapters are likewise kept out of the pod template: the pods mount a ConfigMap listing them
(lora_list) and follow it while they run, and cached adapters are read from the node directories the
pods mount whenever LoRA is on, so a new list changes the ConfigMap only.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from keepwarm_api import lws, podenv, serveflags
from keepwarm_api.common import ModelSource, Parallelism
from keepwarm_api.inferencedeployment import InferenceDeploymentSpec, LoraAdapter, LoraSettings, StartupMode
from keepwarm_api.paths import (
    KERNELS_MOUNT,
    LORA_LIST_FILE,
    LORA_LIST_MOUNT,
    SNAPSHOTS_MOUNT,
    snapshot_store_dir,
)
from keepwarm_api.probes import HEALTH_PATH, ready_long_poll
from keepwarm_api.shutdown import PRESTOP_SLEEP_S, TERMINATION_GRACE_S
from keepwarm_api.weightcache import CachedModel, WeightCacheSpec

from .agent import SNAPSHOT_SECCOMP, builds_kernels, socket_dir
from .meta import GPU_RESOURCE, object_meta, runtime_labels, warm_label_key
from .volumes import ModelMount, hf_volume, host_models_volume, kernels_volume, lora_mount, model_mount

DEPLOYMENT = ("apps/v1", "Deployment")
WARM_AFFINITY_WEIGHT = 100
LORA_LIST_VOLUME = "keepwarm-lora-list"  # never an adapter's: theirs are "lora-<name>"
SHM_VOLUME = "keepwarm-shm"  # /dev/shm of a pod running tensor-parallel ranks
# The readiness probe long-polls /ready for this long per attempt (keepwarm_api.probes), once per
# period: a loading pod always has an attempt waiting, which succeeds the moment the weights are in.
# A second: a container that restarts in its pod (a crash) gets its first attempt within a second of
# its start, before a restored runtime is ready; and a hung one is out of its Service in ~6 s.
READY_POLL_S = 1
# The liveness probe asks the supervising parent's port, which it binds once its imports are done:
# seconds of grace for those imports (a cold GPU image's take 16 s) before the first attempt.
LIVENESS_DELAY_S = 60
SNAPSHOTS_VOLUME = "keepwarm-snapshots"
# What a restore needs in the runtime container: CRIU's file capabilities (the image's criu carries
# cap_checkpoint_restore,cap_setpcap+ep) take effect only for capabilities in the bounding set.
RESTORE_CAPABILITIES = ["CHECKPOINT_RESTORE", "SETPCAP"]


@dataclass(frozen=True)
class CacheBinding:
    """The WeightCache model an InferenceDeployment serves, resolved by the handler."""

    cache: str  # WeightCache name
    spec: WeightCacheSpec  # its spec (socket dir, group, download dir)
    model: CachedModel  # the model entry


def supervisor_port(spec: InferenceDeploymentSpec) -> int:
    """The port of the runtime's supervising parent's /health, the liveness probe's (the next one)."""
    return spec.port + 1


def served_adapters(lora: LoraSettings | None) -> list[LoraAdapter]:
    """The adapters the pods serve: none when LoRA is off."""
    return [] if lora is None or not lora.enabled else list(lora.adapters)


def missing_cached_adapters(lora: LoraSettings | None, model: CachedModel) -> list[str]:
    """Names that served adapters' source.cached gives but the WeightCache model does not list."""
    cached = [a.source.cached for a in served_adapters(lora) if a.source.cached is not None]
    return [name for name in cached if model.adapter(name) is None]


def cached_sources(lora: LoraSettings | None, binding: CacheBinding | None) -> dict[str, ModelSource]:
    """Each served adapter with source.cached: the WeightCache source it names, by served name.
    Raises ValueError for one the cache does not list (the handler reports it first: _resolve)."""
    out: dict[str, ModelSource] = {}
    for adapter in served_adapters(lora):
        if adapter.source.cached is None:
            continue
        entry = None if binding is None else binding.model.adapter(adapter.source.cached)
        if entry is None:
            raise ValueError(f"LoRA adapter {adapter.name!r}: no cached adapter {adapter.source.cached!r}")
        out[adapter.name] = entry.source
    return out


def lora_mounts(
    lora: LoraSettings | None, cached: dict[str, ModelSource], binding: CacheBinding | None
) -> dict[str, ModelMount]:
    """Each served adapter's mount, by name (``cached``: cached_sources); none when LoRA is off."""
    model_directory = "" if binding is None else binding.spec.model_directory
    return {a.name: lora_mount(a, cached.get(a.name), model_directory) for a in served_adapters(lora)}


def lora_list_name(name: str) -> str:
    """The ConfigMap listing the adapters of InferenceDeployment ``name``'s pods."""
    return f"{name}-lora"


def lora_list(
    name: str, namespace: str, spec: InferenceDeploymentSpec, binding: CacheBinding | None,
    owner: dict[str, Any] | None,
) -> dict[str, Any] | None:  # fmt: skip
    """The ConfigMap the pods' `--lora-modules-file` is (None when LoRA is off): each adapter's
    directory inside the pod. The kubelet updates a mounted ConfigMap in place and the runtime follows
    the file, so a new list reaches running pods without a rollout: the pod template names only the
    ConfigMap, and the volumes of adapters not on a claim (lora_mount). Raises ValueError as
    cached_sources does."""
    if spec.lora is None or not spec.lora.enabled:
        return None
    mounts = lora_mounts(spec.lora, cached_sources(spec.lora, binding), binding)
    text = serveflags.lora_modules_file({adapter: mount.path for adapter, mount in mounts.items()})
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_meta(lora_list_name(name), runtime_labels(name), owner, namespace),
        "data": {LORA_LIST_FILE: text},
    }


def lora_args(lora: LoraSettings | None) -> list[str]:
    """`keepwarm serve`'s LoRA flags; unset bounds keep the runtime's defaults (stated only there). The
    adapters themselves are in the mounted list (lora_list), not in the command."""
    if lora is None or not lora.enabled:
        return []
    args = [serveflags.ENABLE_LORA]
    if lora.max_loras is not None:
        args += [serveflags.MAX_LORAS, str(lora.max_loras)]
    if lora.max_lora_rank is not None:
        args += [serveflags.MAX_LORA_RANK, str(lora.max_lora_rank)]
    args += [serveflags.LORA_MODULES_FILE, f"{LORA_LIST_MOUNT}/{LORA_LIST_FILE}"]
    if lora.allow_runtime_updating:
        args.append(serveflags.ALLOW_RUNTIME_LORA_UPDATING)
    return args


def parallel_args(parallelism: Parallelism) -> list[str]:
    """`keepwarm serve`'s tensor/expert parallel flags; none for one rank."""
    if parallelism.tensor == 1:
        return []
    args = [serveflags.TENSOR_PARALLEL_SIZE, str(parallelism.tensor)]
    return [*args, serveflags.ENABLE_EXPERT_PARALLEL] if parallelism.expert else args


def node_gpus(node: dict[str, Any]) -> int:
    """The GPUs a Node offers pods (allocatable nvidia.com/gpu)."""
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    try:
        return int(allocatable.get(GPU_RESOURCE, 0))
    except (TypeError, ValueError):
        return 0


def too_few_gpus(spec: InferenceDeploymentSpec, nodes: list[dict[str, Any]]) -> str | None:
    """Why no node can run one pod's ranks (each takes a GPU), None when one can or when no node
    offers GPUs at all (nothing to judge by: GPU nodes may come with the autoscaler). ``nodes``: the
    Nodes spec.pod.nodeSelector selects."""
    if spec.gpus <= 1:
        return None
    offered = {n["metadata"]["name"]: node_gpus(n) for n in nodes}
    most = max(offered.values(), default=0)
    if most == 0 or most >= spec.gpus:
        return None
    largest = sorted(name for name, gpus in offered.items() if gpus == most)[0]
    return (
        f"parallelism.tensor {spec.parallelism.tensor} needs {spec.gpus} GPUs in one pod, but no node "
        f"offers that many (the most: {most}, on {largest}); spread the ranks over several pods with "
        "parallelism.nodes (a LeaderWorkerSet)"
    )


def snapshot_refusal(spec: InferenceDeploymentSpec, binding: CacheBinding | None) -> str | None:
    """Why spec.startup.mode Snapshot cannot be served as asked (None when it can, or is not asked)."""
    if spec.startup.mode is not StartupMode.SNAPSHOT:
        return None
    if binding is None:
        return (
            "spec.startup.mode Snapshot restores from a WeightCache's snapshot store: set spec.model.cacheRef"
        )
    if not binding.spec.snapshots.enabled:
        return (
            f"spec.startup.mode Snapshot: WeightCache {binding.cache!r} does not enable spec.snapshots; "
            "ask its owner to, or use mode Imports"
        )
    return None


def snapshot_startup(spec: InferenceDeploymentSpec, binding: CacheBinding) -> tuple[dict, dict, list[str]]:
    """Snapshot mode's volume, mount and `keepwarm serve` flags: the store read-only (a snapshot is
    code, written only by the node agent)."""
    store = snapshot_store_dir(binding.spec.snapshots.directory, binding.cache)
    volume = {"name": SNAPSHOTS_VOLUME, "hostPath": {"path": store, "type": "DirectoryOrCreate"}}
    mount = {"name": SNAPSHOTS_VOLUME, "mountPath": SNAPSHOTS_MOUNT, "readOnly": True}
    flags = [serveflags.SNAPSHOT_STORE, SNAPSHOTS_MOUNT]
    flags += [serveflags.RESTORE_TIMEOUT, str(spec.startup.restore_timeout_seconds)]
    return volume, mount, flags


def runtime_command(spec: InferenceDeploymentSpec, model_path: str, model_name: str, dtype: str) -> list[str]:
    command = ["keepwarm", "serve", model_path, "--host", "0.0.0.0", "--port", str(spec.port)]
    command += ["--supervisor-port", str(supervisor_port(spec))]
    command += ["--served-model-name", model_name]
    command += [serveflags.WORKER_LOAD_TIMEOUT, str(spec.startup_timeout_seconds)]
    if dtype != "auto":
        command += ["--dtype", dtype]
    if spec.gpus_per_pod:
        command += ["--device", "cuda"]
    if spec.runtime.max_model_len:
        command += ["--max-model-len", str(spec.runtime.max_model_len)]
    if spec.runtime.max_num_seqs:
        command += ["--max-num-seqs", str(spec.runtime.max_num_seqs)]
    command += parallel_args(spec.parallelism)
    command += lora_args(spec.lora)
    return [*command, *spec.runtime.extra_args]


def workload_kind(spec: InferenceDeploymentSpec) -> tuple[str, str]:
    """(apiVersion, kind) of the runtime pods' owner: a Deployment, or a LeaderWorkerSet for a group
    over several pods (spec.parallelism.nodes > 1)."""
    return (lws.API_VERSION, lws.KIND) if spec.parallelism.nodes > 1 else DEPLOYMENT


def group_name(name: str) -> str:
    """The LeaderWorkerSet of InferenceDeployment ``name``: not ``name`` itself, which the Service
    holds, since LWS names its headless Service (the pods' DNS subdomain) after the set."""
    return f"{name}-group"


def workload_name(name: str, spec: InferenceDeploymentSpec) -> str:
    return group_name(name) if spec.parallelism.nodes > 1 else name


def runtime_workload(
    name: str, namespace: str, spec: InferenceDeploymentSpec, binding: CacheBinding | None,
    owner: dict[str, Any] | None,
) -> dict[str, Any]:  # fmt: skip
    """The Deployment, or the LeaderWorkerSet (workload_kind); raises ValueError as
    runtime_deployment does."""
    deployment = runtime_deployment(name, namespace, spec, binding, owner)
    if spec.parallelism.nodes == 1:
        return deployment
    return leader_worker_set(deployment, spec)


def leader_worker_set(deployment: dict[str, Any], spec: InferenceDeploymentSpec) -> dict[str, Any]:
    """The Deployment's pods as groups of spec.parallelism.nodes pods (a LeaderWorkerSet, one group
    per replica): the leader runs node rank 0 and serves; each worker runs its node rank's ranks,
    headless, its readiness the supervising parent's /health. The ranks meet at the leader's address
    and the worker index LWS gives each pod (its environment, expanded by the kubelet). A pod that
    restarts recreates its whole group: a group over pods cannot restart one rank in place."""
    nodes = spec.parallelism.nodes
    group = [serveflags.NNODES, str(nodes), serveflags.MASTER_ADDR, f"$({lws.LEADER_ADDRESS_ENV})"]
    leader = copy.deepcopy(deployment["spec"]["template"])
    (container,) = leader["spec"]["containers"]
    container["command"] = [*container["command"], *group, serveflags.NODE_RANK, "0"]
    worker = copy.deepcopy(deployment["spec"]["template"])
    (container,) = worker["spec"]["containers"]
    worker_rank = [serveflags.NODE_RANK, f"$({lws.WORKER_INDEX_ENV})", serveflags.HEADLESS]
    container["command"] = [*container["command"], *group, *worker_rank]
    container["ports"] = [p for p in container["ports"] if p["name"] != "http"]  # no API on a worker
    container["readinessProbe"] = dict(container["livenessProbe"], periodSeconds=5, initialDelaySeconds=0)
    worker["metadata"]["annotations"] = {
        k: v for k, v in worker["metadata"]["annotations"].items() if not k.startswith("prometheus.io/")
    }
    return {
        "apiVersion": lws.API_VERSION,
        "kind": lws.KIND,
        "metadata": {**deployment["metadata"], "name": group_name(deployment["metadata"]["name"])},
        "spec": {
            "replicas": spec.replicas,
            # as the Deployment's: an old group serves until a new one is Ready
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"maxUnavailable": 0, "maxSurge": 1},
            },
            "leaderWorkerTemplate": {
                "size": nodes,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": leader,
                "workerTemplate": worker,
            },
        },
    }


def runtime_deployment(
    name: str, namespace: str, spec: InferenceDeploymentSpec, binding: CacheBinding | None,
    owner: dict[str, Any] | None,
) -> dict[str, Any]:  # fmt: skip
    """The Deployment; raises ValueError when the spec names no usable model, or asks for a startup
    the cache cannot give (snapshot_refusal)."""
    if (why := snapshot_refusal(spec, binding)) is not None:
        raise ValueError(why)
    labels = runtime_labels(name)
    if binding is not None:
        model_name, source = binding.model.name, binding.model.source
    elif spec.model.source is not None:
        model_name, source = spec.model.name or name, spec.model.source
    else:
        raise ValueError("spec.model needs a cacheRef and name, or a source")
    dtype = spec.runtime.dtype.value
    if dtype == "auto" and binding is not None:
        dtype = binding.model.dtype.value
    mm = model_mount(model_name, source)
    adapters = lora_mounts(spec.lora, cached_sources(spec.lora, binding), binding)
    volumes, mounts = [], []
    for m in (mm, *adapters.values()):
        if m.volume:
            volumes.append(m.volume)
            mounts.append(m.mount)
    if spec.parallelism.ranks_per_pod > 1:  # ranks meet over shared memory (NCCL; Docker gives 64 MiB)
        volumes.append({"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}})
        mounts.append({"name": SHM_VOLUME, "mountPath": "/dev/shm"})
    lora_on = bool(spec.lora and spec.lora.enabled)
    if lora_on:
        volumes.append({"name": LORA_LIST_VOLUME, "configMap": {"name": lora_list_name(name)}})
        mounts.append({"name": LORA_LIST_VOLUME, "mountPath": LORA_LIST_MOUNT, "readOnly": True})
    env: list[dict[str, Any]] = []
    pod_security: dict[str, Any] = {}
    affinity: dict[str, Any] | None = None
    if binding is not None:
        sockets = socket_dir(binding.spec, binding.cache)
        volumes.append(
            {"name": "keepwarm-sockets", "hostPath": {"path": sockets, "type": "DirectoryOrCreate"}}
        )
        mounts.append({"name": "keepwarm-sockets", "mountPath": sockets})
        # Cached adapters are read where the agent reads them, whichever the list names (lora_mount):
        # with LoRA on, both node directories are mounted, so a new list needs no new volume.
        if lora_on or source.hugging_face is not None:
            volume, mount = hf_volume(binding.spec.download_directory, read_only=True)
            volumes.append(volume)
            mounts.append(mount)
        if lora_on:
            volume, mount = host_models_volume(binding.spec.model_directory)
            volumes.append(volume)
            mounts.append(mount)
        env.append({"name": podenv.CACHE_SOCKET_DIR, "value": sockets})
        if not spec.gpus_per_pod and builds_kernels(binding.spec):
            volume, mount = kernels_volume(binding.spec.download_directory, read_only=True)
            volumes.append(volume)
            mounts.append(mount)
            env.append({"name": podenv.KERNEL_CACHE, "value": KERNELS_MOUNT})
        pod_security["supplementalGroups"] = [binding.spec.socket.group_id]
        affinity = {
            "nodeAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": WARM_AFFINITY_WEIGHT,
                        "preference": {
                            "matchExpressions": [
                                {"key": warm_label_key(binding.cache, model_name), "operator": "Exists"}
                            ]
                        },
                    }
                ]
            }
        }
    env += [
        {"name": podenv.CACHE_MODE, "value": spec.runtime.cache_mode.value},
        {"name": podenv.CACHE_FALLBACK, "value": podenv.env_bool(spec.runtime.cache_fallback)},
    ]
    env += [e.wire() for e in spec.env]
    if spec.pod.run_as_user is not None:
        pod_security["runAsUser"] = spec.pod.run_as_user
    resources = spec.resources.wire() if spec.resources else {}
    if spec.gpus:
        resources.setdefault("limits", {})[GPU_RESOURCE] = spec.gpus
    container: dict[str, Any] = {
        "name": "runtime",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": runtime_command(spec, mm.path, model_name, dtype),
        "env": env,
        "ports": [
            {"name": "http", "containerPort": spec.port, "protocol": "TCP"},
            {"name": "supervisor", "containerPort": supervisor_port(spec), "protocol": "TCP"},
        ],
        "volumeMounts": mounts,
        "resources": resources,
        # No startup probe: its success reaches the readiness probe only at the kubelet's next pod
        # sync, which waits for a relist of the containers (once a second), so every start paid up to
        # a second of it (docs/benchmarks/pod-restart.md). Liveness asks the parent, which is alive while a
        # worker loads; the parent restarts a worker that loads longer than startupTimeoutSeconds.
        "readinessProbe": {
            "httpGet": {"path": ready_long_poll(READY_POLL_S), "port": "http"},
            "periodSeconds": READY_POLL_S,
            "timeoutSeconds": READY_POLL_S + 1,  # the kubelet must not cut the long poll short
            "failureThreshold": 3,
        },
        # The supervising parent's /health: alive while it can still replace a dead or hung worker.
        "livenessProbe": {
            "httpGet": {"path": HEALTH_PATH, "port": "supervisor"},
            "initialDelaySeconds": LIVENESS_DELAY_S,
            "periodSeconds": 10,
            "failureThreshold": 3,
        },
        # A deleted pod serves on while endpoints drop it, then drains (keepwarm_api.shutdown). The
        # kubelet's own sleep action (Kubernetes >= 1.30, the chart's floor): no process in the
        # container, so it needs no shell or binary in the image and costs the pod's memory nothing.
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_S}}},
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    if spec.startup.mode is StartupMode.SNAPSHOT and binding is not None:
        volume, mount, flags = snapshot_startup(spec, binding)
        volumes.append(volume)
        mounts.append(mount)
        container["command"] = [*container["command"], *flags]
        container["securityContext"] = {
            "allowPrivilegeEscalation": True,  # for criu's file capabilities; the server has none
            "capabilities": {"drop": ["ALL"], "add": list(RESTORE_CAPABILITIES)},
            "seccompProfile": dict(SNAPSHOT_SECCOMP),  # clone3 for CRIU's pids (agent.SNAPSHOT_SECCOMP)
        }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
        "volumes": volumes,
        "securityContext": pod_security,
        "nodeSelector": dict(spec.pod.node_selector),
        "tolerations": [t.wire() for t in spec.pod.tolerations],
    }
    if affinity:
        pod_spec["affinity"] = affinity
    if spec.pod.service_account_name:
        pod_spec["serviceAccountName"] = spec.pod.service_account_name
    if spec.pod.priority_class_name:
        pod_spec["priorityClassName"] = spec.pod.priority_class_name
    annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(spec.port),
        **spec.pod.annotations,
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_meta(name, labels, owner, namespace),
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": labels},
            # A spec change never takes serving capacity away: an old pod serves until a new one is
            # Ready (the surge, 25% rounded up, is at least one pod).
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0}},
            "template": {
                "metadata": {"labels": {**spec.pod.labels, **labels}, "annotations": annotations},
                "spec": pod_spec,
            },
        },
    }


def runtime_service(
    name: str, namespace: str, spec: InferenceDeploymentSpec, owner: dict[str, Any] | None
) -> dict[str, Any]:
    labels = runtime_labels(name)
    # a group's leaders alone serve the API
    selector = labels if spec.parallelism.nodes == 1 else {**labels, lws.WORKER_INDEX_LABEL: "0"}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(name, labels, owner, namespace),
        "spec": {
            "type": spec.service_type.value,
            "selector": selector,
            "ports": [{"name": "http", "port": spec.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }
