"""Types shared by the keepwarm custom resources: conditions, model sources, Kubernetes passthroughs.

Every field carries a docstring: pydantic turns it into the CRD description, so `kubectl explain`
shows the same text a reader of this file sees.
"""

from __future__ import annotations

import datetime as dt
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, model_validator
from pydantic.alias_generators import to_camel

from .group import API_VERSION, GROUP, VERSION  # noqa: F401 (re-exported: the models' home)
from .values import DType, Quantization  # noqa: F401 (re-exported: the models' home)

# A Kubernetes resource quantity ("40Gi", "500m", 2): int-or-string, as core types declare it.
Quantity = Annotated[
    int | str,
    WithJsonSchema({"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True}),
]
# An object the API server keeps as written (a core type we pass through without re-modelling).
FreeObject = Annotated[
    dict[str, Any], WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True})
]

DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


class KubeModel(BaseModel):
    """Base: camelCase on the wire, field docstrings become schema descriptions."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, use_attribute_docstrings=True, extra="ignore"
    )

    def wire(self) -> dict[str, Any]:
        """The object as the API server stores it (camelCase, no nulls)."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(KubeModel):
    """One observation of the object's state, in the shape of metav1.Condition."""

    type: str = Field(max_length=316)
    """Condition type, e.g. Ready, Degraded, Available, Progressing, CacheWarm, Stale."""
    status: ConditionStatus
    """True, False or Unknown."""
    reason: str = Field(max_length=1024, pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
    """Stable CamelCase reason; safe to alert on."""
    message: str = Field(default="", max_length=32768)
    """Human-readable detail: what is wrong and what to do about it."""
    last_transition_time: dt.datetime | None = None
    """When status last changed."""
    observed_generation: int | None = Field(default=None, ge=0)
    """metadata.generation this condition was computed from."""


class PVCSource(KubeModel):
    """Model files on a PersistentVolumeClaim (ReadOnlyMany when several nodes read it)."""

    claim_name: str = Field(min_length=1, max_length=253)
    """Name of the PersistentVolumeClaim, in the namespace of the pods that mount it."""
    sub_path: str = ""
    """Directory inside the volume that holds the files: a checkpoint's config.json and safetensors, or
    a LoRA adapter's adapter_config.json and adapter_model.safetensors."""


class SecretKeyRef(KubeModel):
    name: str = Field(min_length=1, max_length=253)
    """Secret name (in the namespace of the pods that read it)."""
    key: str = "token"
    """Key within the Secret."""


class HuggingFaceSource(KubeModel):
    """A Hugging Face Hub repository pinned to a revision (the revision is part of the fingerprint)."""

    repo: str = Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9][-A-Za-z0-9_.]*/[-A-Za-z0-9_.]+$")
    """Repository id, e.g. meta-llama/Llama-3.1-8B-Instruct."""
    revision: str = Field(min_length=1, max_length=128)
    """Commit sha, tag or branch; pin a commit sha for reproducible fingerprints."""
    token_secret_ref: SecretKeyRef | None = None
    """Secret holding a Hub token, for gated or private repositories."""


class ModelSource(KubeModel):
    """Where a model's checkpoint comes from; exactly one of path, pvc, huggingFace."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "[has(self.path), has(self.pvc), has(self.huggingFace)].filter(x, x).size() == 1",
                    "message": "set exactly one of source.path, source.pvc, source.huggingFace",
                }
            ]
        }
    )

    path: str | None = Field(default=None, pattern=r"^/.*", max_length=4096)
    """Absolute directory on the node (a hostPath) holding config.json and the safetensors files (a
    LoRA adapter's: adapter_config.json and adapter_model.safetensors); in a WeightCache it must lie
    under spec.modelDirectory, in an InferenceDeployment under the directory the
    cluster's keepwarm chart allows (tenancyPolicy.inlinePathPrefix, enforced by the API server)."""
    pvc: PVCSource | None = None
    """Model files on a PersistentVolumeClaim."""
    hugging_face: HuggingFaceSource | None = None
    """Download from the Hugging Face Hub into the node's download directory."""


MAX_TENSOR_PARALLEL = 16  # ranks in one pod: one GPU each, and a node offers at most this many


class Parallelism(KubeModel):
    """How a model is split over tensor-parallel ranks: one process each in the runtime pod (one GPU
    each on GPUs), each rank holding its shard (`keepwarm serve --tensor-parallel-size`)."""

    model_config = KubeModel.model_config | {
        "json_schema_extra": {
            "x-kubernetes-validations": [
                {
                    # has(): the API server checks the rule on the default ({}) before defaulting
                    "rule": "!has(self.expert) || !self.expert || (has(self.tensor) && self.tensor > 1)",
                    "message": "parallelism.expert partitions the experts over the tensor-parallel ranks: "
                    "it needs parallelism.tensor > 1",
                }
            ]
        }
    }

    tensor: int = Field(default=1, ge=1, le=MAX_TENSOR_PARALLEL)
    """Ranks the model is split over (attention heads and MLP columns/rows, the vocabulary): the
    model's attention heads must divide by it (the runtime refuses it at start, naming the layer)."""
    expert: bool = False
    """MoE models: partition the experts over the ranks (expert parallel, `--enable-expert-parallel`)
    instead of splitting every expert; needs tensor > 1."""

    @model_validator(mode="after")
    def _expert_needs_ranks(self) -> Parallelism:
        """The API server's rule above, said off the cluster too."""
        if self.expert and self.tensor == 1:
            raise ValueError("parallelism.expert needs parallelism.tensor > 1")
        return self

    def describe(self) -> str:
        """In words, for conditions: "whole", "2 tensor-parallel shards", "4 expert-parallel shards"."""
        if self.tensor == 1:
            return "whole"
        return f"{self.tensor} {'expert' if self.expert else 'tensor'}-parallel shards"


class TolerationOperator(StrEnum):
    EXISTS = "Exists"
    EQUAL = "Equal"


class TaintEffect(StrEnum):
    ANY = ""
    NO_SCHEDULE = "NoSchedule"
    PREFER_NO_SCHEDULE = "PreferNoSchedule"
    NO_EXECUTE = "NoExecute"


class Toleration(KubeModel):
    """A core/v1 Toleration."""

    key: str | None = None
    """Taint key; empty with operator Exists matches every taint."""
    operator: TolerationOperator = TolerationOperator.EQUAL
    """Exists or Equal."""
    value: str | None = None
    """Taint value for operator Equal."""
    effect: TaintEffect | None = None
    """Taint effect to match; empty matches all effects."""
    toleration_seconds: int | None = None
    """For NoExecute: how long the pod stays bound after the taint appears."""


class ResourceRequirements(KubeModel):
    """A core/v1 ResourceRequirements (limits and requests)."""

    limits: dict[str, Quantity] | None = None
    """Maximum resources, e.g. {cpu: 2, memory: 8Gi}."""
    requests: dict[str, Quantity] | None = None
    """Resources the scheduler reserves."""


class EnvVar(KubeModel):
    """A core/v1 EnvVar."""

    name: str = Field(min_length=1)
    """Variable name."""
    value: str | None = None
    """Literal value."""
    value_from: FreeObject | None = None
    """A core/v1 EnvVarSource (secretKeyRef, configMapKeyRef, fieldRef, resourceFieldRef)."""


class SelectorOperator(StrEnum):
    IN = "In"
    NOT_IN = "NotIn"
    EXISTS = "Exists"
    DOES_NOT_EXIST = "DoesNotExist"


class LabelSelectorRequirement(KubeModel):
    """A metav1.LabelSelectorRequirement."""

    key: str = Field(min_length=1)
    """Label key."""
    operator: SelectorOperator
    """In, NotIn, Exists or DoesNotExist."""
    values: list[str] = Field(default_factory=list)
    """Values for In and NotIn."""

    def matches(self, labels: dict[str, str]) -> bool:
        present = self.key in labels
        if self.operator == SelectorOperator.EXISTS:
            return present
        if self.operator == SelectorOperator.DOES_NOT_EXIST:
            return not present
        inside = present and labels[self.key] in self.values
        return inside if self.operator == SelectorOperator.IN else not inside


class LabelSelector(KubeModel):
    """A metav1.LabelSelector: matchLabels and matchExpressions, all of which must hold."""

    match_labels: dict[str, str] = Field(default_factory=dict)
    """Labels the object must carry with these values."""
    match_expressions: list[LabelSelectorRequirement] = Field(default_factory=list)
    """Further requirements on the object's labels."""

    def matches(self, labels: dict[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.match_labels.items()) and all(
            r.matches(labels) for r in self.match_expressions
        )


def first_duplicate(names: list[str]) -> str | None:
    """The first name that appears twice, or None: list-maps keyed by name refuse duplicates on the API
    server, and the models' validators say so off the cluster."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            return name
        seen.add(name)
    return None


def condition(
    type_: str, status: bool | None, reason: str, message: str, generation: int | None
) -> Condition:
    """A condition with the boolean mapped onto True/False/Unknown (time stamped by merge_conditions)."""
    mapped = {True: ConditionStatus.TRUE, False: ConditionStatus.FALSE, None: ConditionStatus.UNKNOWN}
    return Condition(
        type=type_, status=mapped[status], reason=reason, message=message, observed_generation=generation
    )


def merge_conditions(
    old: list[dict[str, Any]] | None, new: list[Condition], now: dt.datetime
) -> list[dict[str, Any]]:
    """New conditions, keeping lastTransitionTime where the status did not change."""
    previous = {c.get("type"): c for c in old or []}
    merged = []
    for cond in new:
        before = previous.get(cond.type)
        stamp = now
        if before and before.get("status") == cond.status.value and before.get("lastTransitionTime"):
            stamp = dt.datetime.fromisoformat(before["lastTransitionTime"].replace("Z", "+00:00"))
        merged.append(cond.model_copy(update={"last_transition_time": stamp}).wire())
    return merged


def upsert_conditions(
    old: list[dict[str, Any]] | None, new: list[Condition], now: dt.datetime
) -> list[dict[str, Any]]:
    """`new` merged in (merge_conditions), every other condition of `old` kept as it was: for a
    writer that owns only some of an object's condition types."""
    replaced = {cond.type for cond in new}
    kept = [c for c in old or [] if c.get("type") not in replaced]
    return [*kept, *merge_conditions(old, new, now)]
