"""Operator start-up: kopf's login and settings, the shared Context built from OperatorSettings."""

from __future__ import annotations

import contextvars
import heapq
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import kopf

from keepwarm_api import GROUP
from keepwarm_api.kube import Kube, connect
from keepwarm_api.kubeconfig import client_configuration

from ..applied import AppliedStore
from ..builders.meta import IDEP_LABEL
from ..settings import OperatorSettings
from ..status import resident_models

POOL_PER_WORKER = 4  # API connections kept per handler worker (see configure)
COALESCE_S = 1.0  # Coalescer's default delay


class Coalescer:
    """Runs fn once, delay_s after the first request for its key, however often the key is asked
    for meanwhile (the latest fn wins); at most `workers` runs at a time, and one per key (a key
    asked for while it runs runs again after: overlapping runs of one cache's refresh each walked
    all its InferenceDeployments and raced each other's status writes).

    While 100 nodes warm up, every node's change would otherwise re-reconcile every
    InferenceDeployment of the cache, and each Deployment's rollout sends a burst of events. One
    timer thread per key ran them all at once: 400 InferenceDeployments made 400 threads contend
    for the API connections and the interpreter (and hold their responses in memory at once).
    """

    def __init__(self, delay_s: float = COALESCE_S, workers: int = 8):
        self.delay_s = delay_s
        self._cv = threading.Condition()
        self._due: list[tuple[float, int, str]] = []  # heap of (due time, sequence, key)
        self._fns: dict[str, Callable[[], None]] = {}  # pending keys -> what to run
        self._running: set[str] = set()
        self._seq = 0
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="keepwarm-refresh")
        self._thread: threading.Thread | None = None

    def submit(self, key: str, fn: Callable[[], None], delay_s: float | None = None) -> None:
        """Never blocks on I/O: async handlers call it from kopf's event loop."""
        ctx = contextvars.copy_context()  # kopf's settings, for posting events from the pool
        with self._cv:
            if key not in self._fns:
                self._seq += 1
                due = time.monotonic() + (self.delay_s if delay_s is None else delay_s)
                heapq.heappush(self._due, (due, self._seq, key))
                self._cv.notify()
            self._fns[key] = lambda: ctx.run(fn)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True, name="keepwarm-coalesce")
                self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._due or self._due[0][0] > time.monotonic():
                    self._cv.wait(self._due[0][0] - time.monotonic() if self._due else None)
                _, _, key = heapq.heappop(self._due)
                if key in self._running:  # again once that run is done
                    self._seq += 1
                    heapq.heappush(self._due, (time.monotonic() + self.delay_s, self._seq, key))
                    continue
                fn = self._fns.pop(key)
                self._running.add(key)
            self._pool.submit(self._run, key, fn)

    def _run(self, key: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:  # the next change or resync retries
            logging.getLogger(__name__).exception("coalesced refresh of %s failed", key)
        finally:
            with self._cv:
                self._running.discard(key)


@dataclass
class Context:
    """What handlers share, carried in kopf's memo."""

    kube: Kube  # API client
    agent_namespace: str  # where DaemonSets and agent ServiceAccounts live
    # kopf's index of WeightCacheNodes (handlers/nodes.py): cache name -> the resident model set of
    # each of its nodes, kept by kopf from its watch (read-only here).
    residency: Mapping[str, Iterable[frozenset[str]]]
    # kopf's index of InferenceDeployments (handlers/inference.py): cache name -> their bodies, cut
    # to what a reconcile reads (inference.index_body).
    deployments_by_cache: Mapping[str, Iterable[dict[str, Any]]] = field(default_factory=dict)
    # kopf's index of WeightCaches (handlers/weightcache.py): name -> its object.
    caches: Mapping[str, Iterable[dict[str, Any]]] = field(default_factory=dict)
    # kopf's index of InferenceDeployments by (namespace, name), bodies cut as in deployments_by_cache.
    inference_deployments: Mapping[tuple[str, str], Iterable[dict[str, Any]]] = field(default_factory=dict)
    namespaces: frozenset[str] = frozenset()  # InferenceDeployments served only here (empty: all)
    resync_seconds: float = 30.0  # resync period (also the retry delay after a failed apply)
    lock: threading.Lock = field(default_factory=threading.Lock)
    applied: AppliedStore = field(default_factory=AppliedStore)  # what we applied (applied.py)
    node_locks: dict[str, threading.Lock] = field(default_factory=dict)  # cache -> see node_lock
    coalescer: Coalescer = field(default_factory=Coalescer)  # refreshes after bursts of events

    def warm_nodes(self, cache: str, model: str) -> int:
        """Nodes where `cache` holds `model`, as the WeightCacheNode watch last reported."""
        nodes = list(self.residency.get(cache, ()))  # one C-level copy: kopf updates it from its loop
        return sum(1 for models in nodes if model in models)

    def node_lock(self, cache: str) -> threading.Lock:
        """Held while one reconcile of `cache` syncs its WeightCacheNodes. kopf runs one handler per
        object at a time, but coalesced refreshes run beside it: at 200 nodes each reconcile listed
        before the others' creates landed and applied every missing WeightCacheNode again (~10x)."""
        with self.lock:
            return self.node_locks.setdefault(cache, threading.Lock())

    def inference_deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The InferenceDeployment as kopf's watch last saw it (None when there is none)."""
        return next(iter(list(self.inference_deployments.get((namespace, name), ()))), None)

    def cache(self, name: str) -> dict[str, Any] | None:
        """The WeightCache `name` as kopf's watch last saw it (None when there is none)."""
        return next(iter(list(self.caches.get(name, ()))), None)

    def coalesce(self, key: str, fn: Callable[[], None], delay_s: float | None = None) -> None:
        """Run fn once, soon, however often this is called for `key` meanwhile (see Coalescer)."""
        self.coalescer.submit(key, fn, delay_s)


def context(memo: Any) -> Context:
    return memo.keepwarm


def residency_moved(body: Mapping[str, Any], type: str | None, memo: Any, subscriber: str) -> bool:
    """Whether a WeightCacheNode event changes the node's resident models from what ``subscriber`` (one
    handler module) last acted on, recording the new set in kopf's per-object ``memo`` if so. Each
    module keeps its own record, so each acts once per change whatever order the handlers run in;
    heartbeats, and a new node that holds nothing yet, change nothing."""
    resident = frozenset() if type == "DELETED" else resident_models(body)
    seen = f"resident.{subscriber}"
    if memo.get(seen, frozenset()) == resident:
        return False
    memo[seen] = resident
    return True


def operator_settings(memo: Any) -> OperatorSettings:
    """The CLI's settings (kopf.operator(memo=...)); defaults when the handlers run without the CLI."""
    return memo.get("settings") or OperatorSettings()


def connection_info(cfg: Any, settings: kopf.OperatorSettings) -> kopf.ConnectionInfo:
    """kopf's credentials from a kubernetes client Configuration (as kopf.login_via_client reads its
    global one)."""
    header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix("authorization")
    parts = header.split(" ", 1) if header else []
    scheme, token = (None, None) if not parts else (None, parts[0]) if len(parts) == 1 else tuple(parts)
    return kopf.ConnectionInfo(
        server=cfg.host,
        ca_path=cfg.ssl_ca_cert,
        insecure=not cfg.verify_ssl,
        username=cfg.username or None,
        password=cfg.password or None,
        scheme=scheme,
        token=token,
        certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file,
        trust_env=settings.networking.trust_env,
    )


@kopf.on.login()
def login(memo: Any, **kwargs: Any) -> kopf.ConnectionInfo:
    """kopf connects as our own client does: --kubeconfig, else in-cluster, else $KUBECONFIG."""
    return connection_info(client_configuration(operator_settings(memo).kubeconfig), kwargs["settings"])


def configure_watching(settings: kopf.OperatorSettings) -> None:
    """Server-side filters: the API server streams only the Deployments the operator owns, not all
    Deployments of the cluster (kopf's handler label filters alone act client-side)."""
    settings.watching.label_selectors["apps", "deployments"] = IDEP_LABEL
    settings.watching.server_timeout = 300


@kopf.on.startup()
def configure(
    settings: kopf.OperatorSettings, memo: Any, residency: kopf.Index, by_cache: kopf.Index,
    caches: kopf.Index, by_name: kopf.Index, **_: Any,
) -> None:  # fmt: skip
    # Our CRDs prune unknown status fields, so kopf keeps its progress in annotations.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{GROUP}/operator"
    # A WeightCache deleted while its resync timer is mid-reconcile keeps kopf's finalizer until kopf
    # re-checks the timer: after 60 s by default, so `kubectl delete wc` hung for a minute now and then.
    settings.background.cancellation_polling = 1.0
    settings.peering.clusterwide = True
    settings.posting.level = logging.WARNING  # handler warnings become events; the rest via kopf.event
    configure_watching(settings)
    ours = operator_settings(memo)
    settings.execution.max_workers = ours.workers
    # One connection per thread that may call at once (kopf's workers, coalesced refreshes): with the
    # client's default of 10, a burst of creates discarded connections and paid a TLS handshake each.
    memo.keepwarm = Context(
        kube=connect(ours.kubeconfig, pool_size=POOL_PER_WORKER * ours.workers),
        agent_namespace=ours.agent_namespace,
        residency=residency,
        deployments_by_cache=by_cache,
        caches=caches,
        inference_deployments=by_name,
        namespaces=ours.namespaces,
        resync_seconds=ours.resync_seconds,
        coalescer=Coalescer(COALESCE_S, ours.workers),
    )
