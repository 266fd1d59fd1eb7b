"""InferenceDeployment (namespaced, short name idep, scale subresource): a model served by N runtime pods.

Becomes a Deployment and a Service. Pods attach to a WeightCache's sockets on their node and prefer
nodes where the model is already resident. spec.replicas is the scale subresource, so `kubectl scale`
and an HPA targeting the InferenceDeployment own the replica count; the operator copies it through.
spec.lora names the LoRA adapters the pods serve on the one base model (`keepwarm serve --enable-lora`).
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field, field_validator, model_validator

from .common import (
    DNS_LABEL,
    MAX_TENSOR_PARALLEL,
    Condition,
    DType,
    EnvVar,
    KubeModel,
    ModelSource,
    Parallelism,
    PVCSource,
    ResourceRequirements,
    Toleration,
    first_duplicate,
)
from .values import CacheMode

KIND = "InferenceDeployment"
PLURAL = "inferencedeployments"
SHORT_NAMES = ["idep"]
DEFAULT_IMAGE = "ghcr.io/keepwarm/keepwarm-runtime:0.1.0"
# The Dockerfile's runtime-cpu target, for CPU nodes (spec.image, and a WeightCache's spec.agent.image).
DEFAULT_CPU_IMAGE = "ghcr.io/keepwarm/keepwarm-runtime-cpu:0.1.0"
# Bounds of spec.lora. An adapter's pod volume is "lora-" + its name, and volume names are DNS labels
# of at most 63 characters. Slots cost max_loras * max_lora_rank rows per targeted projection on the
# device; 512 is the highest rank vLLM serves.
LORA_NAME_MAX = 58
MAX_LORAS_LIMIT = 256
MAX_LORA_RANK_LIMIT = 512
MAX_ADAPTERS = 64


class ModelRef(KubeModel):
    """The model to serve: a model of a WeightCache (cacheRef + name), or an inline source (disk load)."""

    model_config = KubeModel.model_config | {
        "json_schema_extra": {
            "x-kubernetes-validations": [
                {
                    "rule": "has(self.cacheRef) ? (has(self.name) && !has(self.source)) : has(self.source)",
                    "message": "set either cacheRef and name (a model of a WeightCache) or source",
                }
            ]
        }
    }

    cache_ref: str | None = Field(default=None, max_length=63)
    """Name of the WeightCache holding the model."""
    name: str | None = Field(default=None, max_length=63, pattern=DNS_LABEL)
    """Model name within the WeightCache."""
    source: ModelSource | None = None
    """Inline source when not using a cache (always loaded from disk)."""


class RuntimeSettings(KubeModel):
    """Settings of the inference runtime (`keepwarm serve`)."""

    dtype: DType = DType.AUTO
    """Serving dtype; auto follows the cache's dtype (or the checkpoint's)."""
    max_model_len: int | None = Field(default=None, ge=1)
    """Longest sequence (prompt + output) accepted."""
    max_num_seqs: int | None = Field(default=None, ge=1)
    """Most sequences batched at once."""
    cache_mode: CacheMode = CacheMode.ZERO_COPY
    """zero_copy maps the cache's memory; copy copies it into the pod's own memory."""
    cache_fallback: bool = True
    """Load from disk when the cache is absent or mismatched (otherwise fail the start)."""
    extra_args: list[str] = Field(default_factory=list)
    """Further `keepwarm serve` flags, appended verbatim."""


class LoraAdapterSource(KubeModel):
    """Where a PEFT adapter's files (adapter_config.json, adapter_model.safetensors) come from; exactly
    one of cached, pvc, containerPath. No hostPath of its own: the chart's tenancy policy guards only
    spec.model's path; no Hugging Face of its own: downloads are the node agent's. `cached` names an
    adapter the WeightCache lists for the served model (any of its sources, Hub included): the pods
    mount the very files the node's agent caches. A pod registers an adapter from the node cache when
    its directory is the same files the node's daemon read (identity by file), else from disk."""

    model_config = KubeModel.model_config | {
        "json_schema_extra": {
            "x-kubernetes-validations": [
                {
                    "rule": "[has(self.cached), has(self.pvc), has(self.containerPath)]"
                    ".filter(x, x).size() == 1",
                    "message": "set exactly one of source.cached, source.pvc, source.containerPath",
                }
            ]
        }
    }

    cached: str | None = Field(default=None, max_length=63, pattern=DNS_LABEL)
    """Name of an adapter of the served model in its WeightCache (spec.models[].adapters; needs
    spec.model.cacheRef): read where the node's agent reads it (a path in the cache's modelDirectory, a
    Hub adapter in the node's download directory, both mounted read-only; a pvc adapter from its claim,
    at /lora/<adapter name>) and attached zero-copy from the node cache."""
    pvc: PVCSource | None = None
    """Adapter files on a PersistentVolumeClaim, mounted read-only at /lora/<adapter name> (a pod volume:
    adding or removing a pvc adapter rolls the pods)."""
    container_path: str | None = Field(default=None, pattern=r"^/.*", max_length=4096)
    """Absolute directory already inside the runtime container, e.g. baked into the image."""


class LoraAdapter(KubeModel):
    """One LoRA adapter the pods serve; a request selects it by naming it in `model`."""

    name: str = Field(max_length=LORA_NAME_MAX, pattern=DNS_LABEL)
    """Name clients send in `model` (listed in /v1/models with the base as parent); a DNS label of at
    most 58 characters, other than the served model's name."""
    source: LoraAdapterSource
    """Where the adapter's files come from: exactly one of cached, pvc, containerPath."""


class LoraSettings(KubeModel):
    """LoRA adapters on the one base model: every pod serves each of them and the base, mixed in one
    batch. The list reaches the pods as a ConfigMap they mount (`keepwarm serve --lora-modules-file`),
    which running pods follow: changing it rolls no pod, unless it adds or removes a pvc adapter (a pod
    volume)."""

    enabled: bool = True
    """Serve LoRA adapters; false turns them off and keeps the list."""
    max_loras: int | None = Field(default=None, ge=1, le=MAX_LORAS_LIMIT)
    """Adapter slots on the device: most distinct adapters in one batch (unset: the runtime's default);
    requests for more wait for a slot."""
    max_lora_rank: int | None = Field(default=None, ge=1, le=MAX_LORA_RANK_LIMIT)
    """Highest adapter rank accepted (unset: the runtime's default); a pod refuses a higher one by name
    (its log and keepwarm_lora_adapter_refused) and serves the others."""
    adapters: list[LoraAdapter] = Field(
        default_factory=list,
        max_length=MAX_ADAPTERS,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    """Adapters every pod serves, loaded at start and kept in step while pods run (a removed adapter is
    unloaded once its requests finish); names are unique."""
    allow_runtime_updating: bool = False
    """Enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (authorised like every route under
    the runtime's API key); adapters loaded that way last as long as the pod."""

    @field_validator("adapters")
    @classmethod
    def _unique_names(cls, adapters: list[LoraAdapter]) -> list[LoraAdapter]:
        """The API server refuses duplicates (a list-map keyed by name); this says so off the cluster."""
        if (twice := first_duplicate([a.name for a in adapters])) is not None:
            raise ValueError(f"LoRA adapter name {twice!r} appears twice; names are unique")
        return adapters


class StartupMode(StrEnum):
    IMPORTS = "Imports"
    SNAPSHOT = "Snapshot"


class StartupSettings(KubeModel):
    """How a new pod's supervising parent comes up (docs/snapshots.md). Imports: it imports the serving
    path itself (seconds of Python; no privilege). Snapshot: it is restored from the node's snapshot of
    this start when one fits (a second or so), else imports and asks the node agent to take one. The
    runtime container then needs CHECKPOINT_RESTORE and SETPCAP and allowPrivilegeEscalation (CRIU's
    file capabilities): more than Pod Security "baseline" allows, so it is opt-in, and the WeightCache
    must have spec.snapshots.enabled."""

    mode: StartupMode = StartupMode.IMPORTS
    """Imports or Snapshot."""
    restore_timeout_seconds: int = Field(default=30, ge=1, le=600)
    """Seconds a restore may take before the pod imports instead."""


class PodOverrides(KubeModel):
    """Additions to the runtime pods."""

    labels: dict[str, str] = Field(default_factory=dict)
    """Extra pod labels."""
    annotations: dict[str, str] = Field(default_factory=dict)
    """Extra pod annotations."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Hard node constraints (the warm-node preference is added on top)."""
    tolerations: list[Toleration] = Field(default_factory=list)
    """Tolerations, e.g. for tainted GPU nodes."""
    service_account_name: str | None = None
    """ServiceAccount for the pods."""
    priority_class_name: str | None = None
    """PriorityClass for the pods."""
    run_as_user: int | None = Field(default=None, ge=0)
    """UID for the runtime container (default: the image's user)."""


class ServiceType(StrEnum):
    CLUSTER_IP = "ClusterIP"
    NODE_PORT = "NodePort"
    LOAD_BALANCER = "LoadBalancer"


class GroupParallelism(Parallelism):
    """A WeightCache model's Parallelism, and where the ranks run: in one pod, or over ``nodes``
    pods of a LeaderWorkerSet (one per node, each running tensor / nodes ranks)."""

    model_config = Parallelism.model_config | {
        "json_schema_extra": {
            "x-kubernetes-validations": [
                *Parallelism.model_config["json_schema_extra"]["x-kubernetes-validations"],
                {
                    "rule": "!has(self.nodes) || (has(self.tensor) ? self.tensor : 1) % self.nodes == 0",
                    "message": "parallelism.nodes must divide parallelism.tensor: each pod of the group "
                    "runs as many ranks",
                },
            ]
        }
    }

    nodes: int = Field(default=1, ge=1, le=MAX_TENSOR_PARALLEL)
    """Pods (one per node) the ranks span. Above 1 the group runs as a LeaderWorkerSet
    (sigs.k8s.io/lws, which the cluster must have installed): its leader pod runs rank 0 and serves,
    each worker pod runs its share of the ranks, and a pod that restarts restarts the whole group."""

    @model_validator(mode="after")
    def _nodes_divide_the_ranks(self) -> GroupParallelism:
        if self.tensor % self.nodes != 0:
            raise ValueError(f"parallelism.nodes {self.nodes} must divide parallelism.tensor {self.tensor}")
        return self

    @property
    def ranks_per_pod(self) -> int:
        return self.tensor // self.nodes

    def describe(self) -> str:
        whole = super().describe()
        return whole if self.nodes == 1 else f"{whole} over {self.nodes} pods"

    def shards(self) -> Parallelism:
        """The split alone, as a WeightCache model states it (where the ranks run is no cache's matter)."""
        return Parallelism(tensor=self.tensor, expert=self.expert)


class InferenceDeploymentSpec(KubeModel):
    """Desired state of an InferenceDeployment."""

    model_config = KubeModel.model_config | {
        "json_schema_extra": {
            "x-kubernetes-validations": [
                {
                    "rule": "self.gpusPerPod <= 1 || (has(self.parallelism) && has(self.parallelism.tensor)"
                    " && self.gpusPerPod == self.parallelism.tensor)",
                    "message": "a pod takes one GPU per tensor-parallel rank: gpusPerPod is 0 (CPU), 1 or "
                    "parallelism.tensor",
                },
                {
                    "rule": "self.gpusPerPod <= 1 || !has(self.parallelism) || !has(self.parallelism.nodes)"
                    " || self.parallelism.nodes == 1",
                    "message": "a group over several pods (parallelism.nodes > 1) takes one GPU per rank: "
                    "gpusPerPod is 0 (CPU) or 1",
                },
                {
                    "rule": "!has(self.parallelism) || !has(self.parallelism.tensor)"
                    " || self.parallelism.tensor == 1 || !has(self.lora) || !self.lora.enabled",
                    "message": "LoRA adapters are served on one rank only: parallelism.tensor must be 1 "
                    "with spec.lora enabled",
                },
            ]
        }
    }

    model: ModelRef
    """What to serve."""
    replicas: int = Field(default=1, ge=0, le=10000)
    """Runtime pods; owned by the scale subresource (kubectl scale, HPA)."""
    gpus_per_pod: int = Field(default=1, ge=0, le=16)
    """nvidia.com/gpu per pod; 0 for CPU serving. With parallelism.tensor > 1 a GPU pod takes one GPU
    per rank (1 or parallelism.tensor here: the request is parallelism.tensor)."""
    parallelism: GroupParallelism = Field(default_factory=GroupParallelism, json_schema_extra={"default": {}})
    """Split the model over this many ranks (`--tensor-parallel-size`, and `--enable-expert-parallel`
    for MoE), in each pod or, with `nodes`, over a LeaderWorkerSet's pods; each rank attaches its own
    shard from the node cache when the WeightCache model holds the same split (else the pods load from
    disk, and CacheWarm says why). A pod of several ranks gets a memory-backed /dev/shm for them
    (NCCL's transport)."""
    image: str = DEFAULT_IMAGE
    """Runtime image."""
    image_pull_policy: str = Field(default="IfNotPresent", pattern=r"^(Always|IfNotPresent|Never)$")
    """Always, IfNotPresent or Never."""
    runtime: RuntimeSettings = Field(default_factory=RuntimeSettings, json_schema_extra={"default": {}})
    """Runtime settings."""
    lora: LoraSettings | None = None
    """LoRA adapters served on the model."""
    env: list[EnvVar] = Field(default_factory=list)
    """Extra environment variables for the runtime container."""
    resources: ResourceRequirements | None = None
    """CPU/memory for the runtime container (GPUs come from gpusPerPod)."""
    port: int = Field(default=8000, ge=1, le=65535)
    """HTTP port of the OpenAI-compatible API (also serves /metrics, /ready, /health)."""
    service_type: ServiceType = ServiceType.CLUSTER_IP
    """Type of the Service in front of the pods."""
    startup_timeout_seconds: int = Field(default=1800, ge=30)
    """How long a pod's serving process may take to load before it is restarted as hung (in the pod,
    by the runtime's supervising parent; the container, by its liveness probe, once restarts keep
    failing)."""
    pod: PodOverrides = Field(default_factory=PodOverrides, json_schema_extra={"default": {}})
    """Additions to the pods."""
    startup: StartupSettings = Field(default_factory=StartupSettings, json_schema_extra={"default": {}})
    """How a new pod's parent comes up: importing (default) or restored from the node's snapshot."""

    @model_validator(mode="after")
    def _ranks_fit_the_pod(self) -> InferenceDeploymentSpec:
        """The API server's rules above, said off the cluster too."""
        tensor = self.parallelism.tensor
        if self.gpus_per_pod > 1 and self.gpus_per_pod != tensor:
            raise ValueError(
                f"gpusPerPod {self.gpus_per_pod}: a pod takes one GPU per rank (0, 1 or {tensor})"
            )
        if self.gpus_per_pod > 1 and self.parallelism.nodes > 1:
            raise ValueError(
                "a group over several pods (parallelism.nodes > 1) takes one GPU per rank: gpusPerPod is 0 "
                "(CPU) or 1"
            )
        if tensor > 1 and self.lora is not None and self.lora.enabled:
            raise ValueError("LoRA adapters are served on one rank only: parallelism.tensor must be 1")
        return self

    @property
    def gpus(self) -> int:
        """nvidia.com/gpu a pod requests: one per rank it runs on GPUs, none on CPU."""
        return 0 if self.gpus_per_pod == 0 else self.parallelism.ranks_per_pod


class IDepConditionType(StrEnum):
    AVAILABLE = "Available"
    PROGRESSING = "Progressing"
    CACHE_WARM = "CacheWarm"


class IDepReason(StrEnum):
    MINIMUM_REPLICAS = "MinimumReplicasAvailable"
    REPLICAS_UNAVAILABLE = "ReplicasUnavailable"
    SCALED_TO_ZERO = "ScaledToZero"
    ROLLED_OUT = "RolloutComplete"
    ROLLING = "RollingUpdate"
    INVALID_SPEC = "InvalidSpec"
    CACHE_NOT_FOUND = "CacheNotFound"
    NAMESPACE_NOT_ALLOWED = "NamespaceNotAllowed"
    MODEL_NOT_IN_CACHE = "ModelNotInCache"
    ADAPTER_NOT_IN_CACHE = "AdapterNotInCache"
    MODEL_RESIDENT = "ModelResident"
    MODEL_NOT_RESIDENT = "ModelNotResident"
    NO_CACHE = "NoCacheConfigured"
    PARALLELISM_MISMATCH = "ParallelismMismatch"  # the cache holds the model split otherwise
    TOO_FEW_GPUS = "TooFewGPUs"  # more ranks than any node's GPUs (no multi-node groups yet)
    APPLY_FAILED = "ApplyFailed"


class InferenceDeploymentStatus(KubeModel):
    """Observed state, from the Deployment and the cache's WeightCacheNodes."""

    observed_generation: int | None = None
    """metadata.generation this status describes."""
    replicas: int = 0
    """Pods created (statusReplicasPath of the scale subresource)."""
    ready_replicas: int = 0
    """Pods passing readiness."""
    updated_replicas: int = 0
    """Pods on the current template."""
    selector: str = ""
    """Label selector of the pods (labelSelectorPath of the scale subresource, for HPAs)."""
    warm_nodes: int = 0
    """Nodes where the model is resident in the cache."""
    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    """Available, Progressing and CacheWarm."""


PRINTER_COLUMNS = [
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.name"},
    {"name": "Cache", "type": "string", "jsonPath": ".spec.model.cacheRef"},
    {"name": "Desired", "type": "integer", "jsonPath": ".spec.replicas"},
    {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
    {"name": "Warm", "type": "integer", "jsonPath": ".status.warmNodes"},
    {"name": "Available", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Available")].status'},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]
SCALE = {
    "specReplicasPath": ".spec.replicas",
    "statusReplicasPath": ".status.replicas",
    "labelSelectorPath": ".status.selector",
}
ROOT_VALIDATIONS = [
    {
        "rule": "size(self.metadata.name) <= 52",
        "message": "InferenceDeployment names are at most 52 characters",
    },
    {
        # The served name is spec.model.name, else metadata.name (the operator's rule for inline sources).
        "rule": "!has(self.spec) || !has(self.spec.lora) || !has(self.spec.lora.adapters)"
        " || self.spec.lora.adapters.all(a, a.name !="
        " (has(self.spec.model.name) ? self.spec.model.name : self.metadata.name))",
        "message": "a LoRA adapter cannot take the served model's name (spec.model.name, else "
        "metadata.name): clients select adapters by name",
    },
    {
        "rule": "!has(self.spec) || !has(self.spec.lora) || !has(self.spec.lora.adapters)"
        " || has(self.spec.model.cacheRef) || self.spec.lora.adapters.all(a, !has(a.source.cached))",
        "message": "source.cached names an adapter of the served model in its WeightCache: it needs "
        "spec.model.cacheRef",
    },
]
