"""InferenceDeployment: Deployment + Service, status from the Deployment and the cache.

Reconcile, in order:
  1. resolve the model: the WeightCache's entry (cacheRef + name; the cache must allow the namespace)
     or the inline source; a pod of several GPUs (spec.parallelism) needs a node offering them all
  2. apply the LoRA adapter list (a ConfigMap the pods follow: a new list rolls no pod), the Deployment
     (replicas copied from spec.replicas, which the scale subresource owns) and the Service
  3. count warm nodes (WeightCacheNodes reporting the model resident) -> CacheWarm; a cache holding
     the model split otherwise than spec.parallelism (whole, or other shards) is ParallelismMismatch
  4. status from the Deployment -> Available, Progressing
A missing cache or model is a condition with a message, not an error loop; the InferenceDeployment is
reconciled again when its cache's spec changes or its model's residency does (this module's own
handlers of WeightCache and WeightCacheNode events), and every resync period (a timer): a deleted or
edited Service or Deployment is re-applied and a status another client overwrote is restored;
children unchanged since our apply (applied.py) are only read, so a quiet cluster costs no writes.
kopf guards the timer with its finalizer, so deleting an InferenceDeployment waits for a running
operator (as for WeightCaches).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import kopf

from keepwarm_api import API_VERSION, lws
from keepwarm_api.common import Condition, condition, merge_conditions
from keepwarm_api.inferencedeployment import (
    KIND,
    PLURAL,
    IDepConditionType,
    IDepReason,
    InferenceDeploymentSpec,
)
from keepwarm_api.kube import ApiError
from keepwarm_api.weightcache import PLURAL as CACHE_PLURAL
from keepwarm_api.weightcache import WeightCacheSpec
from keepwarm_api.weightcachenode import PLURAL as NODE_PLURAL

from ..applied import UNREAD, ApplyMode, Unread, apply_if_changed, key_of
from ..builders.meta import IDEP_LABEL, runtime_labels, selector_string
from ..builders.runtime import (
    DEPLOYMENT,
    CacheBinding,
    group_name,
    lora_list,
    missing_cached_adapters,
    runtime_service,
    runtime_workload,
    snapshot_refusal,
    too_few_gpus,
    workload_kind,
    workload_name,
)
from ..metrics import APPLIES, reconciling
from ..status import inference_status, now, status_changed
from .setup import Context, context, residency_moved

GROUP, VERSION = API_VERSION.split("/")
C, R = IDepConditionType, IDepReason


def _namespace_allowed(ctx: Context, cache_spec: WeightCacheSpec, namespace: str) -> bool:
    allowed = cache_spec.allowed_namespaces
    if allowed is None:
        return True
    ns = ctx.kube.get("v1", "Namespace", namespace) or {"metadata": {}}
    return allowed.matches(ns["metadata"].get("labels") or {})


def _resolve(
    ctx: Context, spec: InferenceDeploymentSpec, gen: int, namespace: str
) -> tuple[CacheBinding | None, Condition, int]:
    """Step 1 and 3: the cache binding (if any), the CacheWarm condition and the warm node count."""
    ref = spec.model
    if not ref.cache_ref:
        return None, condition(C.CACHE_WARM, False, R.NO_CACHE, "no cacheRef: weights load from disk", gen), 0
    cache = ctx.cache(ref.cache_ref)  # from kopf's index of WeightCaches: no round trip per event
    if cache is None:
        message = f"WeightCache {ref.cache_ref!r} not found; create it or fix spec.model.cacheRef"
        return None, condition(C.CACHE_WARM, False, R.CACHE_NOT_FOUND, message, gen), 0
    cache_spec = WeightCacheSpec.model_validate(cache.get("spec") or {})
    if not _namespace_allowed(ctx, cache_spec, namespace):
        message = (
            f"WeightCache {ref.cache_ref!r} does not allow namespace {namespace!r} (spec.allowedNamespaces)"
        )
        return None, condition(C.CACHE_WARM, False, R.NAMESPACE_NOT_ALLOWED, message, gen), 0
    model = cache_spec.model(ref.name or "")
    if model is None:
        known = ", ".join(m.name for m in cache_spec.models) or "none"
        message = f"WeightCache {ref.cache_ref!r} has no model {ref.name!r} (it has: {known})"
        return None, condition(C.CACHE_WARM, False, R.MODEL_NOT_IN_CACHE, message, gen), 0
    missing = missing_cached_adapters(spec.lora, model)
    if missing:
        known = ", ".join(a.name for a in model.adapters) or "none"
        message = (
            f"WeightCache {ref.cache_ref!r} lists no adapter {', '.join(map(repr, missing))} for model "
            f"{model.name!r} (it has: {known}); fix spec.lora.adapters[].source.cached or add them there"
        )
        return None, condition(C.CACHE_WARM, False, R.ADAPTER_NOT_IN_CACHE, message, gen), 0
    warm = ctx.warm_nodes(ref.cache_ref, model.name)  # from the WeightCacheNode watch, no listing
    binding = CacheBinding(ref.cache_ref, cache_spec, model)
    if model.parallelism != spec.parallelism.shards():  # each rank asks for its own shard: none held so
        message = (
            f"WeightCache {ref.cache_ref!r} holds {model.name} {model.parallelism.describe()}, but this "
            f"InferenceDeployment runs it {spec.parallelism.shards().describe()} (spec.parallelism): its "
            "pods load from disk; give both the same parallelism"
        )
        return binding, condition(C.CACHE_WARM, False, R.PARALLELISM_MISMATCH, message, gen), 0
    if warm:
        cond = condition(
            C.CACHE_WARM, True, R.MODEL_RESIDENT, f"{model.name} resident on {warm} node(s)", gen
        )
    else:
        message = f"{model.name} is not resident on any node yet; pods load from disk until it is"
        cond = condition(C.CACHE_WARM, False, R.MODEL_NOT_RESIDENT, message, gen)
    return binding, cond, warm


def _gpus_refusal(ctx: Context, spec: InferenceDeploymentSpec) -> str | None:
    """Why no node the pods may run on has a GPU for each rank (builders.runtime.too_few_gpus); the
    Nodes are read only for a pod of several GPUs."""
    if spec.gpus <= 1:
        return None
    nodes = ctx.kube.list("v1", "Node", labels=selector_string(spec.pod.node_selector) or None)
    return too_few_gpus(spec, nodes)


def _apply_lora_list(
    ctx: Context, name: str, namespace: str, spec: InferenceDeploymentSpec, binding: CacheBinding | None,
    owner: dict[str, Any], gen: int,
) -> Condition | None:  # fmt: skip
    """The pods' adapter list (builders.runtime.lora_list), applied when it or the object changed: a
    new list reaches running pods through their mounted file, so no pod rolls. A failure's condition."""
    listing = lora_list(name, namespace, spec, binding, owner)
    if listing is None:
        return None
    try:
        if apply_if_changed(ctx.kube, ctx.applied, listing)[1]:  # a read when unchanged
            APPLIES.labels("ConfigMap").inc()
    except ApiError as exc:
        message = f"applying the LoRA adapter list (ConfigMap) failed: {exc}"
        return condition(C.AVAILABLE, False, R.APPLY_FAILED, message, gen)  # reconcile warns with it
    return None


def _apply_children(
    ctx: Context, name: str, namespace: str, spec: InferenceDeploymentSpec, binding: CacheBinding | None,
    owner: dict[str, Any], gen: int, deployment: dict[str, Any] | Unread | None,
) -> tuple[dict[str, Any] | None, Condition | None]:  # fmt: skip
    """Step 2's Deployment and Service, each only if it or its manifest changed since our apply;
    `deployment` as the caller holds it (UNREAD: read when needed). Returns the Deployment as the
    server has it and a failure's condition. The Deployment goes first: its record in ctx.applied
    lets the event of our own apply (it arrives during the Service's round trip) pass unapplied."""
    try:
        manifest = runtime_workload(name, namespace, spec, binding, owner)
        deployment, wrote = apply_if_changed(ctx.kube, ctx.applied, manifest, deployment)
        if wrote:
            APPLIES.labels(manifest["kind"]).inc()
            _delete_other_workload(ctx, name, namespace, spec)
        if apply_if_changed(ctx.kube, ctx.applied, runtime_service(name, namespace, spec, owner))[1]:
            APPLIES.labels("Service").inc()
    except ApiError as exc:
        message = f"applying the {workload_kind(spec)[1]}/Service failed: {exc}"
        if exc.status == 404 and spec.parallelism.nodes > 1:
            message += (
                f" (spec.parallelism.nodes {spec.parallelism.nodes} runs the group as a LeaderWorkerSet: "
                "install sigs.k8s.io/lws in the cluster, docs/parallel.md)"
            )
        kopf.warn(owner, reason=R.APPLY_FAILED.value, message=message)
        held = deployment if isinstance(deployment, dict) else None
        return held, condition(C.AVAILABLE, False, R.APPLY_FAILED, message, gen)
    return deployment, None


def _delete_other_workload(ctx: Context, name: str, namespace: str, spec: InferenceDeploymentSpec) -> None:
    """A change of spec.parallelism.nodes between 1 and more moves the pods between a Deployment and a
    LeaderWorkerSet: the kind no longer used goes (absent, or the LWS API not installed: nothing)."""
    other = (
        (*DEPLOYMENT, name) if spec.parallelism.nodes > 1 else (lws.API_VERSION, lws.KIND, group_name(name))
    )
    with contextlib.suppress(ApiError):
        ctx.kube.delete(*other, namespace)


def reconcile(
    body: dict[str, Any], memo: Any, trigger: str, mode: ApplyMode = ApplyMode.APPLY,
    deployment: dict[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Run steps 1-4; returns the new status (the caller writes it). APPLY and RESYNC apply the
    children that changed (RESYNC with the Deployment as read or as an event showed it), so a quiet
    cluster costs reads; STATUS_ONLY applies nothing. `deployment`: the Deployment as a watch event
    just showed it (read from the API when None; APPLY reads it only to compare)."""
    ctx = context(memo)
    meta = body["metadata"]
    name, namespace, gen = meta["name"], meta["namespace"], meta.get("generation", 0)
    with reconciling(KIND, trigger):
        spec = InferenceDeploymentSpec.model_validate(body.get("spec") or {})
        binding, cache_cond, warm = _resolve(ctx, spec, gen, namespace)
        problem = None
        if mode is ApplyMode.APPLY:
            deployment = None
        elif deployment is None:
            deployment = ctx.kube.get(*workload_kind(spec), workload_name(name, spec), namespace)
        if spec.model.cache_ref and binding is None:
            problem = cache_cond.model_copy(update={"type": C.AVAILABLE})
        elif (refused := _gpus_refusal(ctx, spec)) is not None:
            problem = condition(C.AVAILABLE, False, R.TOO_FEW_GPUS, refused, gen)
        elif (why := snapshot_refusal(spec, binding)) is not None:
            problem = condition(C.AVAILABLE, False, R.INVALID_SPEC, why, gen)
        elif mode is not ApplyMode.STATUS_ONLY:
            problem = _apply_lora_list(ctx, name, namespace, spec, binding, body, gen)
        if problem is None and mode is not ApplyMode.STATUS_ONLY:
            current = UNREAD if mode is ApplyMode.APPLY else deployment
            deployment, failed = _apply_children(ctx, name, namespace, spec, binding, body, gen, current)
            problem = failed
        elif problem is not None and mode is not ApplyMode.STATUS_ONLY:
            kopf.warn(body, reason=problem.reason, message=problem.message)
        selector = selector_string(runtime_labels(name))
        status = inference_status(gen, selector, deployment, spec.replicas, cache_cond, warm, problem)
        wire = status.wire()
        wire["conditions"] = merge_conditions(
            (body.get("status") or {}).get("conditions"), status.conditions, now()
        )
        return wire


def _write_status(
    memo: Any, body: dict[str, Any], trigger: str, mode: ApplyMode, deployment: dict[str, Any] | None = None
) -> None:
    """Status written outside kopf's handlers, guarded by the resourceVersion it was computed from.
    kopf patches the same object (its annotations and finalizer), so a 409 is common: the retry
    re-reads only the InferenceDeployment when the caller passed the Deployment it saw."""

    def compute(current: dict[str, Any]) -> dict[str, Any] | None:
        status = reconcile(current, memo, trigger, mode, deployment)
        return status if status_changed(current.get("status"), status) else None

    meta = body["metadata"]
    context(memo).kube.write_status(API_VERSION, KIND, meta["name"], meta["namespace"], compute, body)


def _cache_view_current(ctx: Context, body: dict[str, Any]) -> bool:
    """Whether the stored status already shows what the cache says now (CacheWarm, warmNodes): all
    that a residency change can move. One that moves nothing for an InferenceDeployment then costs
    no read and no write (each node's first report used to re-read every Deployment of the cache)."""
    meta = body["metadata"]
    spec = InferenceDeploymentSpec.model_validate(body.get("spec") or {})
    _, cond, warm = _resolve(ctx, spec, meta.get("generation", 0), meta["namespace"])
    status = body.get("status") or {}
    stored = next((c for c in status.get("conditions") or [] if c.get("type") == C.CACHE_WARM), {})
    return status.get("warmNodes", 0) == warm and all(stored.get(k) == v for k, v in cond.wire().items())


def refresh_for_cache(memo: Any, cache: str, mode: ApplyMode) -> None:
    """Reconcile the InferenceDeployments served from `cache` (its spec, APPLY, or residency,
    STATUS_ONLY, changed): found in kopf's index of them by cache (no listing); each status write is
    guarded by the resourceVersion of the copy in the index, and re-read if that was stale."""
    ctx = context(memo)
    for body in list(ctx.deployments_by_cache.get(cache, ())):
        if ctx.namespaces and body["metadata"]["namespace"] not in ctx.namespaces:
            continue  # another operator (or none) serves that namespace
        if mode is ApplyMode.STATUS_ONLY and _cache_view_current(ctx, body):
            continue
        _write_status(memo, body, "cache", mode)


INDEXED_META = ("name", "namespace", "uid", "generation", "resourceVersion", "deletionTimestamp")


def index_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """What a reconcile reads of an InferenceDeployment: kopf's index keeps one per object, and the
    whole body (managedFields, kopf's annotations with a second copy of the spec) is mostly ballast."""
    meta = body["metadata"]
    return {
        "apiVersion": body.get("apiVersion", API_VERSION),
        "kind": body.get("kind", KIND),
        "metadata": {k: meta[k] for k in INDEXED_META if k in meta},
        "spec": body.get("spec") or {},
        "status": body.get("status") or {},
    }


@kopf.index(GROUP, VERSION, PLURAL)
async def by_cache(body: kopf.Body, **_: Any) -> dict[str, dict[str, Any]]:
    """WeightCache name -> the InferenceDeployments served from it, as last seen by kopf's watch."""
    cache = ((body.get("spec") or {}).get("model") or {}).get("cacheRef")
    return {cache: index_body(body)} if cache else {}


@kopf.index(GROUP, VERSION, PLURAL)
async def by_name(
    body: kopf.Body, namespace: str, name: str, **_: Any
) -> dict[tuple[str, str], dict[str, Any]]:
    """(namespace, name) -> the InferenceDeployment as last seen: a Deployment's event refreshes its
    owner's status from this copy (a 409 if it is stale, then a read) instead of a GET each."""
    return {(namespace, name): index_body(body)}


@kopf.on.event(GROUP, VERSION, CACHE_PLURAL)
def cache_changed(body: kopf.Body, type: str | None, memo: Any, name: str, **_: Any) -> None:
    """A WeightCache seen first (created, or at start) or with a new spec: its InferenceDeployments
    apply what it says now (its models or sockets may have changed). `memo` is kopf's per-object
    memo of the WeightCache: the generation last acted on (its status writes move none)."""
    generation = body["metadata"].get("generation")
    if type == "DELETED" or body["metadata"].get("deletionTimestamp"):
        return
    if memo.get("generation.inference") == generation:
        return
    memo["generation.inference"] = generation
    refresh_for_cache(memo, name, ApplyMode.APPLY)


@kopf.on.event(GROUP, VERSION, NODE_PLURAL)
async def residency_changed(body: kopf.Body, type: str | None, memo: Any, **_: Any) -> None:
    """A node's resident models changed (not every heartbeat): CacheWarm and warmNodes of the
    cache's InferenceDeployments, on the coalescer's pool (one refresh per burst). `memo` is kopf's
    per-object memo of the WeightCacheNode: its residency as last acted on."""
    cache = (body.get("spec") or {}).get("weightCache")
    if not cache or not residency_moved(body, type, memo, "inference"):
        return
    # also after the initial listing: resumed deployments may have counted early
    context(memo).coalesce(
        f"inference/{cache}", lambda: refresh_for_cache(memo, cache, ApplyMode.STATUS_ONLY)
    )


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
@kopf.on.resume(GROUP, VERSION, PLURAL)
def on_change(body: kopf.Body, patch: kopf.Patch, memo: Any, reason: str, **_: Any) -> None:
    status = reconcile(dict(body), memo, str(reason))
    if status_changed(body.get("status"), status):
        patch.status.update(status)


def resync(body: kopf.Body, patch: kopf.Patch, memo: Any, **_: Any) -> None:
    """Level-based: re-apply the children that drifted (reads only when none did), restore status."""
    if body["metadata"].get("deletionTimestamp"):
        return
    status = reconcile(dict(body), memo, "timer", ApplyMode.RESYNC)
    if status_changed(body.get("status"), status):
        patch.status.update(status)


def register_resync(interval: float) -> None:
    kopf.timer(GROUP, VERSION, PLURAL, interval=interval, initial_delay=interval)(resync)


@kopf.on.event("apps", "v1", "deployments", labels={IDEP_LABEL: kopf.PRESENT})
@kopf.on.event(lws.GROUP, lws.VERSION, lws.PLURAL, labels={IDEP_LABEL: kopf.PRESENT})
async def deployment_changed(body: kopf.Body, type: str | None, memo: Any, **_: Any) -> None:
    """Rollouts show up in status at once, and drift in the Deployment (or the LeaderWorkerSet, where
    the cluster has the API) is re-applied (no-op when none).

    Async and non-blocking (the API calls run on the coalescer's pool): kopf runs a sync handler
    on its worker pool, where each of a rollout's events queued behind every create handler."""
    if type is None:  # initial listing: the resume handlers cover it
        return
    meta = body["metadata"]
    owner = next((o for o in meta.get("ownerReferences", []) if o.get("kind") == KIND), None)
    if owner is None:
        return
    ctx = context(memo)
    key = (meta["namespace"], owner["name"])
    # None: not applied by this process yet (its handler is mid-apply, or it has just started and
    # its resume handler will apply): no re-apply here
    known = ctx.applied.get(key_of(dict(body)))
    drifted = type == "DELETED" or (known is not None and known.drifted(body["kind"], dict(body)))
    ours = known is not None and known.resource_version == meta.get("resourceVersion")
    if ours and not drifted:  # what our apply returned: the status written with it already shows it
        return
    # The event's copy: no GET per event (a deleted one is read back: absent, so it is applied).
    deployment = None if type == "DELETED" else dict(body)
    mode = ApplyMode.RESYNC if drifted else ApplyMode.STATUS_ONLY

    def refresh() -> None:
        namespace, name = key
        # A deleted Deployment is most often the garbage collector following its owner: read the owner
        # from the API, since kopf's index may still hold the deleted InferenceDeployment (its event
        # comes on another watch) and re-applying from that copy would bring the Deployment back.
        indexed = None if type == "DELETED" else ctx.inference_deployment(namespace, name)
        idep = indexed or ctx.kube.get(API_VERSION, KIND, name, namespace)
        if idep is not None:
            _write_status(memo, idep, "deployment", mode, deployment)

    if drifted:  # someone changed or deleted our Deployment: re-apply now
        ctx.coalesce(f"drift/{key[0]}/{key[1]}", refresh, delay_s=0.0)
    else:  # a rollout's status updates come in bursts: one status refresh per burst, the latest copy
        ctx.coalesce(f"idep/{key[0]}/{key[1]}", refresh)
