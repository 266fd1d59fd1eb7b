"""WeightCache (cluster-scoped, short name wc): which models to keep warm, on which nodes, in which tier.

The operator turns one WeightCache into a DaemonSet of node agents (`keepwarm cache serve`) plus one
WeightCacheNode per node the agents run on; the agents report into those.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field, field_validator

from .common import (
    DNS_LABEL,
    Condition,
    DType,
    KubeModel,
    LabelSelector,
    ModelSource,
    Parallelism,
    Quantity,
    Quantization,
    ResourceRequirements,
    Toleration,
    first_duplicate,
)
from .sockets import MAX_GPU_SOCKET_DIR, MAX_SOCKET_PATH_BYTES
from .values import Tier

KIND = "WeightCache"
PLURAL = "weightcaches"
SHORT_NAMES = ["wc"]
DEFAULT_AGENT_IMAGE = "ghcr.io/keepwarm/keepwarm-runtime:0.1.0"
# The operator names children "keepwarm-agent-<name>" and labels them with <name>: 63-char label values.
MAX_NAME_LENGTH = 40
DEFAULT_MODEL_DIRECTORY = "/var/lib/models"
DEFAULT_HEARTBEAT_S = 15
# LoRA adapters per cached model. Bounded so the API server's CEL cost estimate for the path rule
# (every adapter's source.path under modelDirectory) stays within its per-rule budget.
MAX_CACHED_ADAPTERS = 32


class CachedAdapter(KubeModel):
    """A PEFT LoRA adapter of one model, kept resident beside it (its tensors as stored, in the
    cache's dtype): runtime pods attach it zero-copy like the model, matched by file identity."""

    name: str = Field(min_length=1, max_length=63, pattern=DNS_LABEL)
    """Adapter name, unique within its model; reported under status.adapters of each WeightCacheNode."""
    source: ModelSource
    """Where the adapter's directory (adapter_config.json, adapter_model.safetensors) comes from:
    exactly one of path (under spec.modelDirectory), pvc, huggingFace."""


class CachedModel(KubeModel):
    """One model the agents keep resident."""

    name: str = Field(min_length=1, max_length=63, pattern=DNS_LABEL)
    """Model name, unique within the cache; InferenceDeployments refer to it."""
    source: ModelSource
    """Where the checkpoint comes from."""
    dtype: DType = DType.BFLOAT16
    """Dtype the weights are held in (part of the fingerprint)."""
    quantization: Quantization = Quantization.NONE
    """Weight quantization the daemon applies once, at load, into the arena (either tier)."""
    pin: bool = False
    """Pinned models are never evicted to make room under the budget (nor are their adapters)."""
    parallelism: Parallelism = Field(default_factory=Parallelism, json_schema_extra={"default": {}})
    """Hold the model as tensor-parallel shards, one arena each, as InferenceDeployments with the same
    spec.parallelism attach them (each rank its own): on the host tier every shard in the node's one
    daemon; on the gpu tier the i-th GPU's daemon holds shard i mod tensor. Unset: the whole model."""
    adapters: list[CachedAdapter] = Field(
        default_factory=list,
        max_length=MAX_CACHED_ADAPTERS,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    """LoRA adapters of this model the agents keep resident too (at most 32, names unique within the
    model). Counted against the budget like models; a failed adapter fails alone."""

    def adapter(self, name: str) -> CachedAdapter | None:
        return next((a for a in self.adapters if a.name == name), None)

    @field_validator("adapters")
    @classmethod
    def _unique_adapter_names(cls, adapters: list[CachedAdapter]) -> list[CachedAdapter]:
        """The API server refuses duplicates (a list-map keyed by name); this says so off the cluster."""
        if (twice := first_duplicate([a.name for a in adapters])) is not None:
            raise ValueError(f"adapter name {twice!r} appears twice in one model; names are unique")
        return adapters


class GPUAccessMode(StrEnum):
    VISIBLE_DEVICES_ALL = "VisibleDevicesAll"
    NONE = "None"


class GPUAccess(KubeModel):
    """How agents see every GPU on their node without claiming nvidia.com/gpu (which would starve
    inference pods): the NVIDIA container runtime exposes all devices when NVIDIA_VISIBLE_DEVICES=all,
    selected through a RuntimeClass. Use mode None on CPU-only or host-tier clusters."""

    mode: GPUAccessMode = GPUAccessMode.VISIBLE_DEVICES_ALL
    """VisibleDevicesAll: set NVIDIA_VISIBLE_DEVICES=all (+ runtimeClassName); None: no GPU access."""
    runtime_class_name: str | None = "nvidia"
    """RuntimeClass that injects the GPUs; empty to rely on the node's default runtime."""


class AgentSpec(KubeModel):
    """The node agent pods."""

    image: str = DEFAULT_AGENT_IMAGE
    """keepwarm runtime image (contains `keepwarm cache serve`)."""
    image_pull_policy: str = Field(default="IfNotPresent", pattern=r"^(Always|IfNotPresent|Never)$")
    """Always, IfNotPresent or Never."""
    resources: ResourceRequirements | None = None
    """CPU/memory for the agent; host-tier arenas count against its memory limit."""
    priority_class_name: str | None = None
    """PriorityClass for the agents (a system-node-critical class keeps them from eviction)."""
    gpu_access: GPUAccess = Field(default_factory=GPUAccess, json_schema_extra={"default": {}})
    """How agents reach the node's GPUs."""
    metrics_port: int = Field(default=9400, ge=1, le=65535)
    """Port of the agent's /metrics endpoint."""
    hugging_face_endpoint: str | None = Field(default=None, max_length=2048, pattern=r"^https?://[^\s]+$")
    """Where the agents download huggingFace sources from (HF_ENDPOINT): a Hub mirror or proxy inside
    the cluster; unset: huggingface.co."""


class SocketMode(StrEnum):
    SHARED = "0770"
    PRIVATE = "0700"


class SocketSpec(KubeModel):
    """The Unix-socket directory shared by the agent and inference pods. hostPath ignores fsGroup, so
    the agent creates <directory>/<cache name> itself, owned by groupId with the given mode; inference
    pods run with groupId as a supplemental group."""

    directory: str = Field(default="/var/run/keepwarm", pattern=r"^/.*")
    """Host directory under which /<cache name>/ holds the sockets."""
    group_id: int = Field(default=2000, ge=1, le=2147483647)
    """Group owning the socket directory and sockets; inference pods get it as a supplemental group."""
    mode: SocketMode = SocketMode.SHARED
    """0770: directory 0770 and sockets 0660 owned by groupId (pods of other users attach); 0700: the
    agent's user only."""
    allowed_uids: list[int] = Field(default_factory=list, max_length=64)
    """If set, the agent serves only peers with one of these uids (SO_PEERCRED)."""
    allowed_gids: list[int] = Field(default_factory=list, max_length=64)
    """If set, the agent serves only peers with one of these gids (SO_PEERCRED)."""


DEFAULT_SNAPSHOT_DIRECTORY = "/var/lib/keepwarm/snapshots"


class SnapshotStoreSpec(KubeModel):
    """The node-local store of process snapshots (docs/snapshots.md): the agents take snapshots of
    runtime pods' prepared parents on their request, into <directory>/<cache name> on each node;
    InferenceDeployments with spec.startup.mode Snapshot restore them (read-only)."""

    enabled: bool = False
    """Run the snapshot service: the agent pods then get CHECKPOINT_RESTORE, SETUID, SETGID and SETPCAP."""
    directory: str = Field(default=DEFAULT_SNAPSHOT_DIRECTORY, pattern=r"^(/[^/]+)+$", max_length=1024)
    """Host directory under which /<cache name>/ holds the snapshots (root-owned; pods read it only)."""
    budget: Quantity | None = None
    """Bytes the store may hold per node, e.g. 8Gi; least recently used snapshots are evicted beyond it."""


class WeightCacheSpec(KubeModel):
    """Desired state of a WeightCache."""

    model_config = KubeModel.model_config | {
        "json_schema_extra": {
            "x-kubernetes-validations": [
                {
                    "rule": "self.models.all(m, m.dtype == self.models[0].dtype)",
                    "message": "all models of a WeightCache share one dtype (the agent holds one); "
                    "use a second WeightCache for another dtype",
                },
                {
                    "rule": "!has(self.socket.allowedGids) || size(self.socket.allowedGids) == 0"
                    " || self.socket.groupId in self.socket.allowedGids",
                    "message": "socket.groupId must be one of socket.allowedGids when allowedGids is set",
                },
                {
                    "rule": "self.models.all(m, !has(m.source.path)"
                    " || m.source.path.startsWith(self.modelDirectory + '/'))",
                    "message": "source.path must lie under spec.modelDirectory (the one host directory the "
                    "agents mount)",
                },
                {
                    "rule": "self.models.all(m, !has(m.adapters) || m.adapters.all(a, !has(a.source.path)"
                    " || a.source.path.startsWith(self.modelDirectory + '/')))",
                    "message": "an adapter's source.path must lie under spec.modelDirectory (the one host "
                    "directory the agents mount)",
                },
            ]
        }
    }

    models: list[CachedModel] = Field(
        max_length=64,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    """Models to keep resident on every selected node."""
    tier: Tier = Tier.GPU
    """gpu: CUDA VMM memory shared over IPC; host: shared memory (memfd), CPU or GPU clusters."""
    budget: Quantity | None = None
    """Per-node memory budget (per GPU for tier gpu), e.g. 40Gi; unset means no limit but the device's."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Nodes that run an agent, e.g. {nvidia.com/gpu.present: "true"}; empty means every node."""
    tolerations: list[Toleration] = Field(default_factory=list)
    """Tolerations for the agent pods (GPU nodes are often tainted)."""
    agent: AgentSpec = Field(default_factory=AgentSpec, json_schema_extra={"default": {}})
    """The node agent pods."""
    socket: SocketSpec = Field(default_factory=SocketSpec, json_schema_extra={"default": {}})
    """Socket directory, group and access control."""
    allowed_namespaces: LabelSelector | None = None
    """Namespaces whose InferenceDeployments may use this cache, as a namespace label selector (every
    namespace carries kubernetes.io/metadata.name=<its name>); unset allows every namespace. The API
    server refuses others at create (the chart's tenancy policy); the operator refuses the rest."""
    snapshots: SnapshotStoreSpec = Field(default_factory=SnapshotStoreSpec, json_schema_extra={"default": {}})
    """Node-local process snapshots of runtime pods' parents (off unless enabled)."""
    model_directory: str = Field(default=DEFAULT_MODEL_DIRECTORY, pattern=r"^(/[^/]+)+$", max_length=4096)
    """Host directory holding every path source (no trailing slash). The agents mount it once, read
    only, so adding or removing a path model changes no agent pod (their caches stay warm)."""
    download_directory: str = Field(default="/var/cache/keepwarm", pattern=r"^/.*")
    """Host directory where Hugging Face sources are downloaded."""
    heartbeat_seconds: int = Field(default=DEFAULT_HEARTBEAT_S, ge=1, le=3600)
    """How often agents report; a node silent for 4 heartbeats is marked Stale."""

    def model(self, name: str) -> CachedModel | None:
        return next((m for m in self.models if m.name == name), None)


class WeightCacheConditionType(StrEnum):
    READY = "Ready"
    DEGRADED = "Degraded"
    GPUS_MATCH = "GPUsMatch"  # tier gpu: every agent sees as many GPUs as its Node offers pods


class WeightCacheReason(StrEnum):
    ALL_NODES_READY = "AllNodesReady"
    NO_NODES = "NoMatchingNodes"
    NODES_NOT_READY = "NodesNotReady"
    NODES_STALE = "NodesStale"
    MODELS_FAILED = "ModelsFailed"
    AS_EXPECTED = "AsExpected"
    INVALID_SPEC = "InvalidSpec"
    APPLY_FAILED = "ApplyFailed"
    GPU_COUNTS_MATCH = "GPUCountsMatch"
    GPU_COUNT_MISMATCH = "GPUCountMismatch"


class ModelResidency(KubeModel):
    """How many nodes hold one model."""

    name: str
    """Model name."""
    resident_nodes: int = 0
    """Nodes whose agent reports the model resident."""
    failed_nodes: int = 0
    """Nodes whose agent failed to load it."""


class AdapterResidency(KubeModel):
    """How many nodes hold one LoRA adapter of a model (spec.models[].adapters)."""

    model: str
    """The model it adapts."""
    name: str
    """Adapter name, unique within its model."""
    resident_nodes: int = 0
    """Nodes whose agent reports the adapter resident (on every GPU, on the gpu tier)."""
    failed_nodes: int = 0
    """Nodes whose agent failed to load it."""


class WeightCacheStatus(KubeModel):
    """Observed state, aggregated from the WeightCacheNodes by the operator."""

    observed_generation: int | None = None
    """metadata.generation this status describes."""
    desired_nodes: int = 0
    """Nodes that should run an agent (DaemonSet desiredNumberScheduled)."""
    ready_nodes: int = 0
    """Nodes whose agent reports in time and holds every model and every adapter."""
    stale_nodes: int = 0
    """Nodes whose agent stopped reporting."""
    model_count: int = 0
    """Number of models in spec."""
    models: list[ModelResidency] = Field(default_factory=list)
    """Per-model resident node counts."""
    adapters: list[AdapterResidency] = Field(default_factory=list)
    """Per-adapter resident node counts, by model and adapter name."""
    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    """Ready and Degraded."""


PRINTER_COLUMNS = [
    {"name": "Tier", "type": "string", "jsonPath": ".spec.tier"},
    {"name": "Models", "type": "integer", "jsonPath": ".status.modelCount"},
    {"name": "Desired", "type": "integer", "jsonPath": ".status.desiredNodes"},
    {"name": "Ready", "type": "integer", "jsonPath": ".status.readyNodes"},
    {"name": "Status", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].reason'},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]
ROOT_VALIDATIONS = [
    {
        "rule": f"size(self.metadata.name) <= {MAX_NAME_LENGTH}",
        "message": f"WeightCache names are at most {MAX_NAME_LENGTH} characters (children add a prefix)",
    },
    {
        # The agent binds <socket.directory>/<name>/gpu-<GPU UUID>.sock (builders.agent.socket_dir).
        "rule": "self.spec.tier != 'gpu'"
        f" || size(self.spec.socket.directory) + 1 + size(self.metadata.name) <= {MAX_GPU_SOCKET_DIR}",
        "message": f"on the gpu tier, socket.directory + '/' + the WeightCache name is at most "
        f"{MAX_GPU_SOCKET_DIR} characters: each GPU's socket, gpu-<GPU UUID>.sock, is placed there, and a "
        f"Unix socket path is at most {MAX_SOCKET_PATH_BYTES} bytes",
    },
]
