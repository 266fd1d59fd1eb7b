"""The node agent loop: follow this node's WeightCacheNode spec, load/evict in the daemon, report status.

The operator writes the models this node should hold into the WeightCacheNode's spec; the agent
watches that one object (a list+watch with a metadata.name field selector, no polling), so model
sources reach it without any change to its pod. Hub tokens are read from Secrets in the agent's own
namespace through the API (the operator's per-cache Role names exactly those Secrets).

Loads run on a small thread pool (`max_loads` at a time), so one slow or hung download does not hold
up the rest; the daemon itself loads into its arena one model at a time. A download that adds no bytes
for `stall_timeout_s` is stopped and fails (download.py). Failed and evicted models are
retried by themselves with capped exponential backoff (state.retry_delay), the next try reported in
the model's status (retryAt); a spec change retries at once.

Started by `keepwarm cache serve --report-to-kubernetes --weightcache NAME --node-name NODE` in a
daemon thread. Three threads: the watch follows the spec (and the stored status), this one reconciles
(local work only), a reporter renews the node's Lease every heartbeat (keepwarm_api.lease: liveness,
so a long load never looks like a dead agent) and writes the WeightCacheNode status only when it
changed: a steady node costs one small Lease write per heartbeat and no WeightCacheNode write. The
kubernetes client is an optional dependency (extra `kubernetes`).
"""

from __future__ import annotations

import base64
import datetime as dt
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

from keepwarm_api import GROUP, VERSION, podenv
from keepwarm_api import lease as node_lease
from keepwarm_api import weightcachenode as wcn
from keepwarm_api.paths import HF_MOUNT, HOST_MODELS_MOUNT, MODELS_ROOT, hf_cache_dir
from keepwarm_api.settings import present
from keepwarm_api.weightcache import DEFAULT_HEARTBEAT_S
from keepwarm_api.weightcachenode import WeightCacheNodeSpec
from keepwarm_runtime import __version__
from keepwarm_runtime.cache.settings import MAX_LOADS, STALL_TIMEOUT_S

if TYPE_CHECKING:
    from keepwarm_runtime.cache.settings import CacheServeSettings

from .download import download
from .state import (
    RETRY_BASE_S,
    AgentState,
    WantedModel,
    fresh_since,
    load_options,
    node_status,
    now,
    retry_delay,
    status_differs,
    wanted_models,
)

log = logging.getLogger(__name__)
WATCH_TIMEOUT_S = 300  # the API server ends each watch after this; the agent re-lists and watches on
WATCH_RETRY_S = 2.0  # after a failed list or watch


class AgentDependencyError(ImportError):
    pass


class TokenSecretError(RuntimeError):
    """A model's tokenSecretRef names a Secret or key that is not there (fails that model only)."""


def _clients() -> tuple[Any, Any]:
    """(CustomObjectsApi, CoreV1Api) with the pod's token, or KUBECONFIG outside a cluster."""
    try:
        from kubernetes import client, config
    except ImportError as exc:
        raise AgentDependencyError(
            "the node agent needs the kubernetes client: pip install 'keepwarm-runtime[kubernetes]'"
        ) from exc
    try:
        config.load_incluster_config()
        api_client = client.ApiClient()
    except config.ConfigException:
        api_client = config.new_client_from_config(config_file=os.environ.get("KUBECONFIG"))
    return client.CustomObjectsApi(api_client), client.CoreV1Api(api_client)


class NodeAgent:
    def __init__(
        self, daemon: Any, cache: str, node: str, api: Any, *, core: Any = None,
        namespace: str | None = None, host_root: str | None = None, pvc_root: str | None = None,
        hf_root: str | None = None,
        retry_base_s: float = RETRY_BASE_S, max_loads: int = MAX_LOADS,
        stall_timeout_s: float = STALL_TIMEOUT_S,
    ):  # fmt: skip
        self.daemon, self.cache, self.node, self.api, self.core = daemon, cache, node, api, core
        self.namespace = namespace or os.environ.get("POD_NAMESPACE", "default")  # token Secrets live here
        self.host_root = host_root or present(os.environ.get(podenv.HOST_MODEL_ROOT)) or HOST_MODELS_MOUNT
        self.pvc_root = pvc_root or present(os.environ.get(podenv.MODEL_ROOT)) or MODELS_ROOT
        self.hf_root = hf_root or present(os.environ.get(podenv.DOWNLOAD_ROOT)) or HF_MOUNT
        self.retry_base_s = retry_base_s  # failed/evicted models: first retry after this, then doubling
        self.stall_timeout_s = stall_timeout_s
        self.pool = ThreadPoolExecutor(max_workers=max_loads, thread_name_prefix="agent-load")
        self.inflight: dict[str, Future[None]] = {}
        self.resolved: dict[str, str] = {}  # model name -> the directory it was loaded from
        self.state = AgentState()
        self.wanted: list[WantedModel] = []
        self.heartbeat_s = float(DEFAULT_HEARTBEAT_S)
        self.lock = threading.Lock()
        self.wake = threading.Event()  # the reporter: report now
        self.changed = threading.Event()  # the reconciler: the spec changed or a load finished
        self.desired: dict[str, Any] | None = None  # this node's WeightCacheNode as last seen
        # ... and as last seen by the reporter, from the watch or its own write (status and uid)
        self.seen: dict[str, Any] | None = None
        self.renewed = -float("inf")  # time.monotonic() of the last Lease renewal (or attempt)
        self.lease_held = False  # the last renewal succeeded
        self._coordination: Any = None

    @property
    def object_name(self) -> str:
        return wcn.object_name(self.cache, self.node)

    def fetch(self) -> dict[str, Any] | None:
        """This node's WeightCacheNode now (None until the operator created it); a list by name, as
        the agent may list and watch but not get."""
        found = self.api.list_cluster_custom_object(
            GROUP, VERSION, wcn.PLURAL, field_selector=f"metadata.name={self.object_name}"
        )
        items = found.get("items") or []
        return items[0] if items else None

    def reconcile(self, obj: dict[str, Any]) -> None:
        """One pass: start loads of what is wanted and missing, release what is no longer wanted.

        Local work only (no API calls); loads run on the pool, see settle().
        """
        generation = obj["metadata"].get("generation")
        spec = WeightCacheNodeSpec.model_validate(obj.get("spec") or {})
        self.heartbeat_s = float(spec.heartbeat_seconds)
        wanted = wanted_models(spec, self.host_root, self.pvc_root)
        with self.lock:
            self.wanted = wanted
            self.state.message = ""
            if generation != self.state.generation:  # spec changed: retry failures and evictions now
                self.state.failed.clear()
                self.state.evicted.clear()
                self.state.attempts.clear()
                self.state.retry_at.clear()
                self.state.generation = generation
        names = {w.name for w in wanted}
        self._reap()
        for name in sorted(set(self._loaded()) - names - set(self.inflight)):
            with self.lock:
                daemon_name = self.state.daemon_names.pop(name)
            self.daemon.remove_model(daemon_name)
            log.info("released %s (removed from WeightCacheNode %s)", name, self.object_name)
        resident = self.daemon.snapshot()["models"]
        for w in wanted:
            if w.name in self.inflight:
                continue
            daemon_name = self._loaded().get(w.name)
            if daemon_name in resident:
                if w.pin and not resident[daemon_name]["pinned"]:  # no-op reload; marks pinned
                    self.daemon.add_model(self.resolved.get(w.name) or self._path(w), **load_options(w))
                continue
            if daemon_name is not None:  # was loaded, now gone: evicted under the budget
                with self.lock:
                    self.state.daemon_names.pop(w.name)
                    self.state.evicted.add(w.name)
                    self._schedule_retry(w.name)
            retry_at = self.state.retry_at.get(w.name)
            if retry_at is not None and now() < retry_at:
                continue  # failed or evicted: wait for the backoff
            with self.lock:
                self.state.loading.add(w.name)
            self.inflight[w.name] = self.pool.submit(self._load, w)
            self.wake.set()  # report Loading now

    def _loaded(self) -> dict[str, str]:
        """Model name -> daemon name, copied under the lock (loads add to it from the pool)."""
        with self.lock:
            return dict(self.state.daemon_names)

    def settle(self, timeout_s: float | None = None) -> None:
        """Wait for the loads in flight (tests and shutdown; the loop itself never waits)."""
        wait(list(self.inflight.values()), timeout=timeout_s)
        self._reap()

    def _reap(self) -> None:
        for name, future in list(self.inflight.items()):
            if future.done():
                del self.inflight[name]

    def _schedule_retry(self, name: str) -> None:
        """Caller holds the lock: one more failure in a row, next try after the backoff."""
        attempts = self.state.attempts.get(name, 0) + 1
        self.state.attempts[name] = attempts
        self.state.retry_at[name] = now() + dt.timedelta(seconds=retry_delay(attempts, self.retry_base_s))

    def _token(self, w: WantedModel) -> str | None:
        """The Hub token from its Secret in the agent's namespace, read through the API when needed."""
        if w.token is None:
            return None
        from kubernetes.client import ApiException

        try:
            secret = self.core.read_namespaced_secret(w.token.name, self.namespace)
        except ApiException as exc:
            raise TokenSecretError(
                f"tokenSecretRef: Secret {self.namespace}/{w.token.name} could not be read ({exc.status} "
                f"{exc.reason})"
            ) from exc
        data = secret.data or {}
        if w.token.key not in data:
            raise TokenSecretError(
                f"tokenSecretRef: Secret {self.namespace}/{w.token.name} has no key {w.token.key!r}"
            )
        return base64.b64decode(data[w.token.key]).decode().strip()

    def _path(self, w: WantedModel) -> str:
        if w.path is not None:
            return w.path
        assert w.repo is not None and w.revision is not None  # a Hub source (wanted_models)
        return download(w.repo, w.revision, hf_cache_dir(self.hf_root), self._token(w), self.stall_timeout_s)

    def _load(self, w: WantedModel) -> None:
        try:
            path = self._path(w)
            self.resolved[w.name] = path  # a later pin needs no second download
            daemon_name = self.daemon.add_model(path, **load_options(w))
        except Exception as exc:  # a bad checkpoint fails this model, not the agent
            log.warning("loading %s failed: %s", w.name, exc)
            with self.lock:
                self.state.failed[w.name] = f"{type(exc).__name__}: {exc}"
                self._schedule_retry(w.name)
        else:
            with self.lock:
                self.state.daemon_names[w.name] = daemon_name
                self.state.failed.pop(w.name, None)
                self.state.evicted.discard(w.name)
                self.state.attempts.pop(w.name, None)
                self.state.retry_at.pop(w.name, None)
        finally:
            with self.lock:
                self.state.loading.discard(w.name)
            self.wake.set()
            self.changed.set()  # another pass: a load may have evicted another model

    def report(self) -> bool:
        """Write the WeightCacheNode status if it changed (not its heartbeat stamp alone); False while
        the operator has not created the object yet."""
        from kubernetes.client import ApiException

        with self.lock:
            stored = None if self.seen is None else self.seen.get("status") or {}
            self.state.reporting_since = fresh_since(stored, self.state.reporting_since, now())
            status = node_status(self.state, self.daemon.snapshot(), self.wanted, __version__)
        if not status_differs(stored, status):
            return True
        try:
            self.seen = self.api.patch_cluster_custom_object_status(
                GROUP, VERSION, wcn.PLURAL, self.object_name, {"status": status.wire()},
                _content_type="application/merge-patch+json",
            )  # fmt: skip
            return True
        except ApiException as exc:
            if exc.status == 404:
                log.info("WeightCacheNode %s not created yet; retrying", self.object_name)
                return False
            raise

    def coordination(self) -> Any:
        """CoordinationV1Api on the same connection as the custom objects API."""
        if self._coordination is None:
            from kubernetes import client

            self._coordination = client.CoordinationV1Api(self.api.api_client)
        return self._coordination

    def renew(self) -> bool:
        """Renew this node's Lease (create it, owned by the WeightCacheNode, on the first renewal or
        after the garbage collector removed it with an old WeightCacheNode). False while there is no
        WeightCacheNode yet: nothing to be stale."""
        from kubernetes.client import ApiException

        self.renewed = time.monotonic()
        owner = self.seen or self.desired
        if owner is None:
            return False
        duration = int(wcn.STALE_HEARTBEATS * self.heartbeat_s)
        coordination = self.coordination()
        try:
            coordination.patch_namespaced_lease(
                self.object_name, self.namespace, node_lease.renewal(now(), self.node, duration),
                _content_type="application/merge-patch+json",
            )  # fmt: skip
        except ApiException as exc:
            if exc.status != 404:
                raise
            body = node_lease.node_lease(
                self.object_name, self.namespace, self.cache, self.node, duration, now(), owner
            )
            # Created by server-side apply: the client's create would re-serialize MicroTimes wrongly.
            coordination.patch_namespaced_lease(
                self.object_name, self.namespace, body, field_manager="keepwarm-agent", force=True,
                _content_type="application/apply-patch+yaml",
            )  # fmt: skip
        return True

    def _follow(self, obj: dict[str, Any] | None) -> None:
        self.desired = obj
        self.seen = obj
        self.changed.set()

    def run_watch(self, stop: threading.Event) -> None:
        """List this node's WeightCacheNode, then watch it from that resourceVersion; on any error
        (410 Gone included) or the server's timeout, list and watch again."""
        from kubernetes import watch

        selector = f"metadata.name={self.object_name}"
        while not stop.is_set():
            try:
                listing = self.api.list_cluster_custom_object(
                    GROUP, VERSION, wcn.PLURAL, field_selector=selector
                )
                found = listing.get("items") or []
                self._follow(found[0] if found else None)  # fetch(), keeping the resourceVersion
                stream = watch.Watch().stream(
                    self.api.list_cluster_custom_object, GROUP, VERSION, wcn.PLURAL,
                    field_selector=selector, resource_version=listing["metadata"]["resourceVersion"],
                    timeout_seconds=WATCH_TIMEOUT_S,
                )  # fmt: skip
                for event in stream:
                    if stop.is_set():
                        return
                    if event["type"] in ("ADDED", "MODIFIED"):
                        self._follow(event["raw_object"])
                    elif event["type"] == "DELETED":
                        self._follow(None)
            except Exception as exc:  # API hiccups must not end the watch
                log.warning("watching WeightCacheNode %s failed: %s", self.object_name, exc)
                stop.wait(WATCH_RETRY_S)

    def _renewal_due(self) -> float:
        """time.monotonic() of the next renewal: a heartbeat after the last one, sooner while there
        is no Lease yet (the WeightCacheNode not seen, or the last try failed)."""
        return self.renewed + (self.heartbeat_s if self.lease_held else WATCH_RETRY_S)

    def run_reporter(self, stop: threading.Event) -> None:
        """Renew the Lease every heartbeat; on every wake (a pass of the reconciler, a load done) and
        every heartbeat, write the status if it changed."""
        while not stop.is_set():
            if time.monotonic() >= self._renewal_due():
                try:
                    self.lease_held = self.renew()
                except Exception as exc:  # API hiccups must not kill the reporter
                    self.lease_held = False
                    log.warning("renewing the Lease of %s failed: %s", self.object_name, exc)
            try:
                self.report()
            except Exception as exc:
                log.warning("reporting WeightCacheNode %s failed: %s", self.object_name, exc)
            self.wake.wait(max(0.0, self._renewal_due() - time.monotonic()))
            self.wake.clear()

    def _next_pass_s(self) -> float:
        """Until the next backoff expires, at most a heartbeat (evictions by the daemon are local)."""
        with self.lock:
            due = [(t - now()).total_seconds() for t in self.state.retry_at.values()]
        return max(0.5, min([self.heartbeat_s, *due]))

    def run(self, stop: threading.Event) -> None:
        for target, name in ((self.run_reporter, "agent-reporter"), (self.run_watch, "agent-watch")):
            threading.Thread(target=target, args=(stop,), daemon=True, name=name).start()
        while not stop.is_set():
            self.changed.clear()
            self._reap()
            obj = self.desired
            try:
                if obj is None:
                    self.state.message = f"waiting for WeightCacheNode {self.object_name}"
                else:
                    self.reconcile(obj)
            except Exception as exc:
                log.warning("agent pass for %s failed: %s", self.object_name, exc)
                self.state.message = f"{type(exc).__name__}: {exc}"[:1000]
            self.wake.set()
            self.changed.wait(self._next_pass_s())
        self.wake.set()
        self.pool.shutdown(wait=False, cancel_futures=True)


def run_agent(daemon: Any, settings: CacheServeSettings, stop: threading.Event | None = None) -> None:
    """Entry point for `keepwarm cache serve --report-to-kubernetes` (runs until the daemon stops)."""
    try:
        api, core = _clients()
    except AgentDependencyError as exc:
        log.error("%s", exc)
        return
    stop = stop or getattr(daemon, "_stop", None) or threading.Event()
    agent = NodeAgent(
        daemon, settings.weightcache, settings.node_name, api, core=core,
        max_loads=settings.max_loads, stall_timeout_s=settings.stall_timeout,
    )  # fmt: skip
    agent.run(stop)
