"""The node agent loop: follow the WeightCache, load/evict in the daemon, report the WeightCacheNode.

Failed and evicted models are retried by themselves with exponential backoff (state.retry_delay), the
next try reported in the model's message; a spec change retries at once.

Started by `keepwarm cache serve --report-to-kubernetes --weightcache NAME --node-name NODE` in a
daemon thread. Two threads: this one reconciles (loads can take minutes), a reporter writes the
status every heartbeat so a long load never looks like a dead agent. The kubernetes client is an
optional dependency (extra `kubernetes`).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import threading
from typing import TYPE_CHECKING, Any

from keepwarm_api import GROUP, VERSION, podenv
from keepwarm_api import weightcache as wc
from keepwarm_api import weightcachenode as wcn
from keepwarm_api.paths import MODELS_ROOT, hf_cache_dir
from keepwarm_api.settings import present
from keepwarm_api.weightcache import WeightCacheSpec
from keepwarm_runtime import __version__

if TYPE_CHECKING:
    from keepwarm_runtime.cache.settings import CacheServeSettings

from .state import (
    RETRY_BASE_S,
    AgentState,
    WantedModel,
    load_options,
    node_status,
    now,
    retry_delay,
    wanted_models,
)

log = logging.getLogger(__name__)
DEFAULT_HEARTBEAT_S = float(WeightCacheSpec.model_fields["heartbeat_seconds"].default)


class AgentDependencyError(ImportError):
    pass


def _client() -> Any:
    try:
        from kubernetes import client, config
    except ImportError as exc:
        raise AgentDependencyError(
            "the node agent needs the kubernetes client: pip install 'keepwarm-runtime[kubernetes]'"
        ) from exc
    try:
        config.load_incluster_config()
        return client.CustomObjectsApi(client.ApiClient())
    except config.ConfigException:
        return client.CustomObjectsApi(
            config.new_client_from_config(config_file=os.environ.get("KUBECONFIG"))
        )


class NodeAgent:
    def __init__(
        self, daemon: Any, cache: str, node: str, api: Any, model_root: str | None = None,
        retry_base_s: float = RETRY_BASE_S,
    ):  # fmt: skip
        self.daemon, self.cache, self.node, self.api = daemon, cache, node, api
        self.retry_base_s = retry_base_s  # failed/evicted models: first retry after this, then doubling
        self.model_root = model_root or present(os.environ.get(podenv.MODEL_ROOT)) or MODELS_ROOT
        self.state = AgentState()
        self.wanted: list[WantedModel] = []
        self.heartbeat_s = DEFAULT_HEARTBEAT_S
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.last_report = self.state.reporting_since

    @property
    def object_name(self) -> str:
        return wcn.object_name(self.cache, self.node)

    def fetch(self) -> dict[str, Any] | None:
        from kubernetes.client import ApiException

        try:
            return self.api.get_cluster_custom_object(GROUP, VERSION, wc.PLURAL, self.cache)
        except ApiException as exc:
            if exc.status == 404:
                self.state.message = f"WeightCache {self.cache!r} not found"
                return None
            raise

    def reconcile(self, cache: dict[str, Any]) -> None:
        """One pass: load what is wanted and missing, release what is no longer wanted."""
        generation = cache["metadata"].get("generation")
        spec = WeightCacheSpec.model_validate(cache.get("spec") or {})
        self.heartbeat_s = float(spec.heartbeat_seconds)
        wanted = wanted_models(spec, self.model_root)
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
        for name in sorted(set(self.state.daemon_names) - names):
            self.daemon.remove_model(self.state.daemon_names.pop(name))
            log.info("released %s (removed from WeightCache %s)", name, self.cache)
        resident = self.daemon.snapshot()["models"]
        for w in wanted:
            daemon_name = self.state.daemon_names.get(w.name)
            if daemon_name in resident:
                if w.pin and not resident[daemon_name]["pinned"]:
                    self.daemon.add_model(self._path(w), **load_options(w))  # no reload; marks pinned
                continue
            if daemon_name is not None:  # was loaded, now gone: evicted under the budget
                self.state.daemon_names.pop(w.name)
                with self.lock:
                    self.state.evicted.add(w.name)
                    self._schedule_retry(w.name)
            retry_at = self.state.retry_at.get(w.name)
            if retry_at is not None and now() < retry_at:
                continue  # failed or evicted: wait for the backoff
            self._load(w)

    def _schedule_retry(self, name: str) -> None:
        """Caller holds the lock: one more failure in a row, next try after the backoff."""
        attempts = self.state.attempts.get(name, 0) + 1
        self.state.attempts[name] = attempts
        delay = retry_delay(attempts, self.retry_base_s)
        self.state.retry_at[name] = now() + dt.timedelta(seconds=delay)

    def _path(self, w: WantedModel) -> str:
        if w.path is not None:
            return w.path
        from huggingface_hub import snapshot_download  # a transformers dependency

        token = present(os.environ.get(podenv.hf_token(w.name)))
        return snapshot_download(w.repo, revision=w.revision, cache_dir=hf_cache_dir(), token=token)

    def _load(self, w: WantedModel) -> None:
        with self.lock:
            self.state.loading.add(w.name)
        self.wake.set()  # report Loading now
        try:
            self.state.daemon_names[w.name] = self.daemon.add_model(self._path(w), **load_options(w))
        except Exception as exc:  # a bad checkpoint fails this model, not the agent
            log.warning("loading %s failed: %s", w.name, exc)
            with self.lock:
                self.state.failed[w.name] = f"{type(exc).__name__}: {exc}"
                self._schedule_retry(w.name)
        else:
            with self.lock:
                self.state.failed.pop(w.name, None)
                self.state.evicted.discard(w.name)
                self.state.attempts.pop(w.name, None)
                self.state.retry_at.pop(w.name, None)
        finally:
            with self.lock:
                self.state.loading.discard(w.name)
        self.wake.set()

    def report(self) -> bool:
        """Write the WeightCacheNode status; False while the operator has not created it yet."""
        from kubernetes.client import ApiException

        with self.lock:
            if (now() - self.last_report).total_seconds() > wcn.STALE_HEARTBEATS * self.heartbeat_s:
                self.state.reporting_since = now()  # silent long enough to be Stale: a transition
            status = node_status(self.state, self.daemon.snapshot(), self.wanted, __version__)
        try:
            self.api.patch_cluster_custom_object_status(
                GROUP, VERSION, wcn.PLURAL, self.object_name, {"status": status.wire()},
                _content_type="application/merge-patch+json",
            )  # fmt: skip
            self.last_report = now()
            return True
        except ApiException as exc:
            if exc.status == 404:
                log.info("WeightCacheNode %s not created yet; retrying", self.object_name)
                return False
            raise

    def run_reporter(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.report()
            except Exception as exc:  # API hiccups must not kill the reporter
                log.warning("reporting WeightCacheNode %s failed: %s", self.object_name, exc)
            self.wake.wait(self.heartbeat_s)
            self.wake.clear()

    def run(self, stop: threading.Event) -> None:
        reporter = threading.Thread(
            target=self.run_reporter, args=(stop,), daemon=True, name="agent-reporter"
        )
        reporter.start()
        while not stop.is_set():
            try:
                cache = self.fetch()
                if cache is not None:
                    self.reconcile(cache)
            except Exception as exc:
                log.warning("agent pass for %s failed: %s", self.cache, exc)
                self.state.message = f"{type(exc).__name__}: {exc}"[:1000]
            self.wake.set()
            stop.wait(min(self.heartbeat_s, 10.0))
        self.wake.set()
        reporter.join(timeout=5)


def run_agent(daemon: Any, settings: CacheServeSettings, stop: threading.Event | None = None) -> None:
    """Entry point for `keepwarm cache serve --report-to-kubernetes` (runs until the daemon stops)."""
    try:
        api = _client()
    except AgentDependencyError as exc:
        log.error("%s", exc)
        return
    stop = stop or getattr(daemon, "_stop", None) or threading.Event()
    NodeAgent(daemon, settings.weightcache, settings.node_name, api).run(stop)
