"""WeightCache -> node agents: ServiceAccount, least-privilege ClusterRole(+Binding) and Role(+Binding),
DaemonSet.

The pod template depends on the cache's settings (image, tier, dtype, socket, budget, directories),
never on its model list: models reach the agents through their WeightCacheNode specs, path sources
through one read-only mount of spec.modelDirectory, Hub tokens through the API (the Role names the
Secrets). Adding or removing a model (or a model's LoRA adapter) therefore rolls no agent and drops
no cache. The exception is a pvc source, a model's or an adapter's: a claim can only be mounted by the
pod spec, so adding or removing one rolls the agents.

On the gpu tier the agent runs one daemon per GPU it sees (`--all-gpus`, each on gpu-<UUID>.sock),
since an inference pod attaches the socket of the GPU the device plugin gave it.

GPU access without claiming nvidia.com/gpu (claiming it would take GPUs away from inference pods): with
gpuAccess.mode VisibleDevicesAll the pod sets NVIDIA_VISIBLE_DEVICES=all and runs under the RuntimeClass
that makes the NVIDIA container runtime inject every device (the device plugin's "all" pass-through).

Upgrades surge: each node runs the new pod beside the old one, whose daemon and descriptor holder hand
everything over to the new pod's (cache/succession.py, cache/holder.py) and then idle until deleted
(``--after-handoff wait``: an exited container would be restarted and take everything back). The
holder container keeps every arena's descriptor, so an agent container that crashes restarts warm.

The socket directory is a hostPath, which ignores fsGroup: the agent runs as root with only CHOWN and
FOWNER (no other capabilities), creates /var/run/keepwarm/<cache>/ with group socket.groupId and mode
socket.mode (setgid, so sockets inherit the group), and inference pods run with that group.

With spec.snapshots.enabled the agent also runs the snapshot service (keepwarm_runtime.snapshot,
docs/snapshots.md): it mounts the cache's snapshot store read-write and gets SETUID, SETGID, SETPCAP and
CHECKPOINT_RESTORE besides, and no seccomp filter (CRIU cannot dump a filtered process unprivileged);
the holder container never gets them.

On the host tier (CPU nodes) an init container builds keepwarm's CPU attention kernel for the node's
CPU into the node's kernel folder (keepwarm_api.paths.kernel_cache_dir; a no-op once built, a logged
no-op in an image without a compiler); CPU runtime pods mount it read-only (builders/runtime.py), so a
node compiles it once and no inference pod can write code another one loads.
"""

from __future__ import annotations

from typing import Any

from kubernetes.utils.quantity import parse_quantity

from keepwarm_api import GROUP, podenv
from keepwarm_api.lease import LEASE_GROUP
from keepwarm_api.paths import KERNELS_MOUNT, SNAPSHOTS_MOUNT, snapshot_store_dir
from keepwarm_api.weightcache import GPUAccessMode, SocketMode, Tier, WeightCacheSpec

from .meta import agent_labels, agent_name, object_meta
from .volumes import cached_adapter_mount, hf_volume, host_models_volume, kernels_volume, model_mount

SOCKET_MOUNT = "/var/run/keepwarm"
# The agent's snapshot service (spec.snapshots.enabled): it starts a pod's parent under the pod's uid
# and groups (SETUID, SETGID) with no capability (SETPCAP empties its bounding set), and CRIU dumps it as
# that uid with CHECKPOINT_RESTORE as an ambient capability (docs/snapshots.md).
SNAPSHOT_CAPABILITIES = ["SETUID", "SETGID", "SETPCAP", "CHECKPOINT_RESTORE"]
# Seccomp of the containers that dump (the agent) and restore (Snapshot-mode runtime pods), set
# explicitly so a kubelet's --seccomp-default cannot change it: CRIU cannot dump a process under any
# seccomp filter without CAP_SYS_ADMIN (PTRACE_O_SUSPEND_SECCOMP), and the runtime's default profile
# answers clone3 with ENOSYS, whose fallback (/proc/sys/kernel/ns_last_pid) is read-only in a
# container (both seen with runc; docs/snapshots.md). Restores alone also work under a Localhost
# profile of RuntimeDefault plus clone3.
SNAPSHOT_SECCOMP = {"type": "Unconfined"}
SNAPSHOTS_VOLUME = "snapshots"
# Builds the CPU attention kernel (keepwarm_runtime.engine.attention.native; --optional: a node that
# cannot build it says why and the agent starts anyway).
KERNEL_BUILD = ["python", "-m", "keepwarm_runtime.engine.attention.native", "--optional"]


def builds_kernels(spec: WeightCacheSpec) -> bool:
    """Whether the cache's agent pods build the CPU kernel for their node: host tier, CPU nodes."""
    return spec.tier == Tier.HOST


def socket_dir(spec: WeightCacheSpec, cache: str) -> str:
    """The socket directory on the node, also its path inside agent and runtime pods."""
    return f"{spec.socket.directory.rstrip('/')}/{cache}"


def token_secrets(spec: WeightCacheSpec) -> list[str]:
    """Names of the Secrets holding the cache's Hub tokens, its models' and their adapters' (in the
    agent namespace)."""
    sources = [s for m in spec.models for s in (m.source, *(a.source for a in m.adapters))]
    refs = (s.hugging_face.token_secret_ref for s in sources if s.hugging_face)
    return sorted({ref.name for ref in refs if ref is not None})


def agent_rbac(
    cache: str, namespace: str, owner: dict[str, Any] | None, secrets: list[str] | None = None
) -> list[dict[str, Any]]:
    """The calls the agent makes: list+watch its WeightCacheNode, patch its status, get its tokens,
    create and renew its node's Lease (keepwarm_api.lease) in the agent namespace.

    RBAC cannot name "the object for my node" (names are per node), so any agent of this cache may
    read any WeightCacheNode (specs hold model sources, no secrets) and patch any one's status (the
    chart's ValidatingAdmissionPolicy narrows that to its own node). It cannot create, delete or change
    their spec. Secrets: only those named by the cache's tokenSecretRefs, in the agent namespace (no
    rule at all when there are none: an empty resourceNames would mean every Secret).
    """
    name = agent_name(cache)
    labels = agent_labels(cache)
    rules = [
        {"apiGroups": [GROUP], "resources": ["weightcachenodes"], "verbs": ["list", "watch"]},
        {"apiGroups": [GROUP], "resources": ["weightcachenodes/status"], "verbs": ["patch"]},
    ]
    secret_rules = (
        [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": list(secrets), "verbs": ["get"]}]
        if secrets
        else []
    )
    lease_rules = [{"apiGroups": [LEASE_GROUP], "resources": ["leases"], "verbs": ["create", "patch"]}]
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": object_meta(name, labels, owner, namespace),
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": object_meta(name, labels, owner),
            "rules": rules,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": object_meta(name, labels, owner),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": object_meta(name, labels, owner, namespace),
            "rules": lease_rules + secret_rules,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": object_meta(name, labels, owner, namespace),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
        },
    ]


def budget_bytes(budget: int | str | None) -> int | None:
    """A Kubernetes quantity ("40Gi") as bytes, the unit `keepwarm cache serve --budget` takes."""
    return None if budget is None else int(parse_quantity(budget))


def allowed_gids(spec: WeightCacheSpec) -> list[int]:
    """The peer groups the daemon serves. Sharing the socket with groupId means serving that group:
    the daemon itself allows only its own uid plus --allow-uid/--allow-gid, so without this the
    inference pods (groupId as a supplemental group) could open the socket and be refused. Explicit
    allowedUids alone keep the daemon to those uids (allowedGids, when set, includes groupId: CEL)."""
    if spec.socket.allowed_gids or spec.socket.mode != SocketMode.SHARED or spec.socket.allowed_uids:
        return list(spec.socket.allowed_gids)
    return [spec.socket.group_id]


def agent_command(spec: WeightCacheSpec, cache: str) -> list[str]:
    dtype = spec.models[0].dtype.value if spec.models else "bfloat16"
    command = [
        "keepwarm", "cache", "serve",
        "--socket-dir", socket_dir(spec, cache),
        "--tier", spec.tier.value,
        "--dtype", "bfloat16" if dtype == "auto" else dtype,
        "--metrics-port", str(spec.agent.metrics_port),
    ]  # fmt: skip
    if spec.tier == Tier.GPU:  # one daemon per GPU of the node: a pod attaches the socket of its GPU
        command += ["--all-gpus"]
    if spec.socket.mode == SocketMode.SHARED:
        command += ["--group", str(spec.socket.group_id)]
    budget = budget_bytes(spec.budget)
    if budget is not None:
        command += ["--budget", str(budget)]
    for uid in spec.socket.allowed_uids:
        command += ["--allow-uid", str(uid)]
    for gid in allowed_gids(spec):
        command += ["--allow-gid", str(gid)]
    if spec.snapshots.enabled:
        command += ["--snapshot-store", SNAPSHOTS_MOUNT]
        snapshot_budget = budget_bytes(spec.snapshots.budget)
        if snapshot_budget is not None:
            command += ["--snapshot-budget", str(snapshot_budget)]
    command += ["--after-handoff", "wait"]  # a surge pod took over: idle until deleted, never restarted
    node = f"$({podenv.NODE_NAME})"  # the downward API variable, expanded by the kubelet
    return [*command, "--report-to-kubernetes", "--weightcache", cache, "--node-name", node]


def holder_command(spec: WeightCacheSpec, cache: str) -> list[str]:
    """`keepwarm cache hold`: keeps the daemons' arena descriptors, so a crashed agent restarts warm."""
    command = [
        "keepwarm",
        "cache",
        "hold",
        "--socket-dir",
        socket_dir(spec, cache),
        "--after-handoff",
        "wait",
    ]
    if spec.socket.mode == SocketMode.SHARED:
        command += ["--group", str(spec.socket.group_id)]
    return command


def agent_daemonset(
    cache: str, spec: WeightCacheSpec, namespace: str, owner: dict[str, Any] | None
) -> dict[str, Any]:
    """The DaemonSet running one agent per selected node."""
    labels = agent_labels(cache)
    sockets = socket_dir(spec, cache)
    hf, hf_mount = hf_volume(spec.download_directory, read_only=False)
    host_models, host_models_mount = host_models_volume(spec.model_directory)
    volumes: list[dict[str, Any]] = [
        {"name": "sockets", "hostPath": {"path": sockets, "type": "DirectoryOrCreate"}},
        {"name": "tmp", "emptyDir": {}},
        host_models,
        hf,
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "sockets", "mountPath": sockets},
        {"name": "tmp", "mountPath": "/tmp"},
        host_models_mount,
        hf_mount,
    ]
    env: list[dict[str, Any]] = [
        {"name": podenv.NODE_NAME, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": podenv.POD_NAMESPACE, "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "HOME", "value": "/tmp"},  # read-only root filesystem: caches go to the emptyDir
    ]
    if spec.agent.hugging_face_endpoint:
        env.append({"name": podenv.HF_ENDPOINT, "value": spec.agent.hugging_face_endpoint})
    for model in sorted(spec.models, key=lambda m: m.name):
        if model.source.pvc is not None:  # the one source a pod spec must name (see the docstring)
            mm = model_mount(model.name, model.source)
            volumes.append(mm.volume)
            mounts.append(mm.mount)
        for adapter in sorted(model.adapters, key=lambda a: a.name):
            if adapter.source.pvc is not None:
                am = cached_adapter_mount(model.name, adapter.name, adapter.source.pvc)
                volumes.append(am.volume)
                mounts.append(am.mount)
    pod_spec: dict[str, Any] = {
        "serviceAccountName": agent_name(cache),
        "nodeSelector": dict(spec.node_selector),
        "tolerations": [t.wire() for t in spec.tolerations],
        "securityContext": {"runAsUser": 0, "runAsGroup": spec.socket.group_id},
        "containers": [],
        "volumes": volumes,
    }
    gpu = spec.tier == Tier.GPU and spec.agent.gpu_access.mode == GPUAccessMode.VISIBLE_DEVICES_ALL
    if gpu:
        env += [
            {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
            {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "compute,utility"},
        ]
        if spec.agent.gpu_access.runtime_class_name:
            pod_spec["runtimeClassName"] = spec.agent.gpu_access.runtime_class_name
    if spec.agent.priority_class_name:
        pod_spec["priorityClassName"] = spec.agent.priority_class_name
    container: dict[str, Any] = {
        "name": "agent",
        "image": spec.agent.image,
        "imagePullPolicy": spec.agent.image_pull_policy,
        "command": agent_command(spec, cache),
        "env": env,
        "ports": [{"name": "metrics", "containerPort": spec.agent.metrics_port}],
        "volumeMounts": mounts,
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]},
        },
        "livenessProbe": {
            "httpGet": {"path": "/metrics", "port": "metrics"},
            "periodSeconds": 20,
            "failureThreshold": 3,
        },
        # The daemon serves /metrics only once its socket listens (after a hand-off: once it took
        # over): Ready then, so the rolling update moves to the next node only after this one's.
        "readinessProbe": {
            "httpGet": {"path": "/metrics", "port": "metrics"},
            "periodSeconds": 5,
            "failureThreshold": 2,
        },
    }
    if spec.snapshots.enabled:
        store = snapshot_store_dir(spec.snapshots.directory, cache)
        pod_spec["volumes"].append(
            {"name": SNAPSHOTS_VOLUME, "hostPath": {"path": store, "type": "DirectoryOrCreate"}}
        )
        mounts.append({"name": SNAPSHOTS_VOLUME, "mountPath": SNAPSHOTS_MOUNT})
        container["securityContext"] = {
            **container["securityContext"],
            "capabilities": {"drop": ["ALL"], "add": ["CHOWN", "FOWNER", *SNAPSHOT_CAPABILITIES]},
            "seccompProfile": dict(SNAPSHOT_SECCOMP),
        }
    if spec.agent.resources:
        container["resources"] = spec.agent.resources.wire()
    holder = {  # a second process of the pod: survives the agent container's restarts (cache/holder.py)
        "name": "holder",
        "image": spec.agent.image,
        "imagePullPolicy": spec.agent.image_pull_policy,
        "command": holder_command(spec, cache),
        "env": [{"name": "HOME", "value": "/tmp"}],
        "volumeMounts": [{"name": "sockets", "mountPath": sockets}, {"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": {  # the agent's, without the snapshot service's capabilities
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]},
        },
        # It allocates nothing: the arenas' pages stay charged to the cgroup that first touched them.
        "resources": {"requests": {"cpu": "10m", "memory": "64Mi"}},
    }
    pod_spec["containers"] += [container, holder]
    if builds_kernels(spec):
        volume, mount = kernels_volume(spec.download_directory, read_only=False)
        pod_spec["volumes"].append(volume)
        pod_spec["initContainers"] = [
            {
                "name": "kernels",
                "image": spec.agent.image,
                "imagePullPolicy": spec.agent.image_pull_policy,
                "command": KERNEL_BUILD,
                "env": [
                    {"name": "TORCH_EXTENSIONS_DIR", "value": KERNELS_MOUNT},  # torch's builder writes here
                    {"name": "HOME", "value": "/tmp"},
                ],
                "volumeMounts": [mount, {"name": "tmp", "mountPath": "/tmp"}],
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "readOnlyRootFilesystem": True,
                    "capabilities": {"drop": ["ALL"]},
                },
            }
        ]
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": object_meta(agent_name(cache), labels, owner, namespace),
        "spec": {
            "selector": {"matchLabels": labels},
            # One node at a time, old and new pod side by side: the new agent takes the arenas, the
            # socket and the lock over from the old one (cache/succession.py), so no node goes cold.
            "updateStrategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "template": {
                "metadata": {
                    "labels": labels,
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(spec.agent.metrics_port),
                    },
                },
                "spec": pod_spec,
            },
        },
    }


def agent_children(
    cache: str, spec: WeightCacheSpec, namespace: str, owner: dict[str, Any] | None
) -> list[dict[str, Any]]:
    """Everything one WeightCache needs, in apply order (RBAC before the pods that use it)."""
    rbac = agent_rbac(cache, namespace, owner, token_secrets(spec))
    return [*rbac, agent_daemonset(cache, spec, namespace, owner)]
