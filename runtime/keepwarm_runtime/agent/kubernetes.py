"""The node agent loop: follow this node's WeightCacheNode spec, load/evict in the daemon, report status.

The operator writes the models this node should hold into the WeightCacheNode's spec; the agent
watches that one object (a list+watch with a metadata.name field selector, no polling), so model
sources reach it without any change to its pod. Hub tokens are read from Secrets in the agent's own
namespace through the API (the operator's per-cache Role names exactly those Secrets).

The agent drives one daemon per GPU (`--all-gpus`, or the `--fake-gpu` test twin; cache/gpus.py) or
the host tier's one, and keeps every wanted model in each: a pod attaches the daemon of the GPU it was
given. Each daemon has its own bookkeeping (state.DaemonBook): a model can be resident on one GPU,
loading on a second and failed on a third, and is reported so, per GPU, in the status.

A model's LoRA adapters (spec.models[].adapters) are jobs like models: resolved from their source the
same way, loaded with ``add_model(kind="adapter")``, retried and released the same way, and reported
under status.adapters; an adapter that fails to load fails alone (its model and the other adapters
stay as they are).

Loads run on a small thread pool (`max_loads` at a time, one job per model and daemon), so one slow or
hung download does not hold up the rest; a Hub model is downloaded once per node (the daemons' jobs
share it under a per-model lock); each daemon loads into its arena one model at a time. A download
that adds no bytes for `stall_timeout_s` is stopped and fails (download.py). Failed and evicted models
are retried by themselves with capped exponential backoff (state.retry_delay), the next try reported in
the model's status (retryAt); a spec change retries at once.

Started by `keepwarm cache serve --report-to-kubernetes --weightcache NAME --node-name NODE` in a
daemon thread. Three threads: the watch follows the spec (and the stored status), this one reconciles
(local work only), a reporter renews the node's Lease every heartbeat (keepwarm_api.lease: liveness,
so a long load never looks like a dead agent) and writes the WeightCacheNode status only when it
changed: a steady node costs one small Lease write per heartbeat and no WeightCacheNode write. It
talks to the API server through keepwarm_api.kube, the operator's client too, whose kubernetes client
is an optional dependency here (extra `kubernetes`).
"""

from __future__ import annotations

import base64
import datetime as dt
import logging
import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

from keepwarm_api import API_VERSION
from keepwarm_api import lease as node_lease
from keepwarm_api import weightcachenode as wcn
from keepwarm_api.kube import AGENT_FIELD_MANAGER, GONE, ApiError, Kube, connect
from keepwarm_api.paths import HF_MOUNT, HOST_MODELS_MOUNT, MODELS_ROOT, hf_cache_dir
from keepwarm_api.weightcache import DEFAULT_HEARTBEAT_S
from keepwarm_api.weightcachenode import WeightCacheNodeSpec
from keepwarm_runtime import __version__
from keepwarm_runtime.cache.snapshot import DaemonSnapshot, ModelSnapshot

if TYPE_CHECKING:
    from keepwarm_runtime.cache.settings import CacheServeSettings
    from keepwarm_runtime.snapshot.service import SnapshotService

from .download import download
from .settings import MAX_LOADS, NAMESPACE, STALL_TIMEOUT_S
from .state import (
    RETRY_BASE_S,
    AgentState,
    DaemonBook,
    Entry,
    WantedModel,
    fresh_since,
    load_options,
    node_status,
    now,
    retry_delay,
    shard_entries,
    status_differs,
    wanted_models,
)

log = logging.getLogger(__name__)
WATCH_RETRY_S = 2.0  # after a failed list or watch


class AgentDependencyError(ImportError):
    pass


class TokenSecretError(RuntimeError):
    """A model's tokenSecretRef names a Secret or key that is not there (fails that model only)."""


def _kube() -> Kube:
    """The client with the pod's token, or KUBECONFIG outside a cluster (keepwarm_api's loader)."""
    try:
        return connect(field_manager=AGENT_FIELD_MANAGER)
    except ImportError as exc:
        raise AgentDependencyError(
            "the node agent needs the kubernetes client: pip install 'keepwarm-runtime[kubernetes]'"
        ) from exc


def by_name(name: str) -> str:
    """The field selector of one object: the agent may list and watch its WeightCacheNode, not get it."""
    return f"metadata.name={name}"


def fetch_node_object(kube: Kube, name: str) -> dict[str, Any] | None:
    """The WeightCacheNode `name` (None until the operator created it), listed by name."""
    items = kube.list(API_VERSION, wcn.KIND, fields=by_name(name))
    return items[0] if items else None


def daemon_key(daemon: Any) -> str:
    """The GPU UUID a daemon serves ("" for the host tier's one): its key in books and status."""
    return getattr(daemon, "serves_gpu", None) or ""


class NodeAgent:
    def __init__(
        self, daemon: Any | list[Any], cache: str, node: str, kube: Kube | None, *,
        namespace: str = NAMESPACE, host_root: str = HOST_MODELS_MOUNT, pvc_root: str = MODELS_ROOT,
        hf_root: str = HF_MOUNT,
        retry_base_s: float = RETRY_BASE_S, max_loads: int = MAX_LOADS,
        stall_timeout_s: float = STALL_TIMEOUT_S, snapshots: SnapshotService | None = None,
    ):  # fmt: skip
        daemons = daemon if isinstance(daemon, list) else [daemon]
        self.daemons = {daemon_key(d): d for d in daemons}  # GPU UUID ("" for host.sock) -> daemon
        self.cache, self.node, self.kube = cache, node, kube  # kube: None in tests that never call
        self.namespace = namespace  # token Secrets live here
        self.host_root = host_root  # the WeightCache's modelDirectory: path sources
        self.pvc_root = pvc_root  # pvc sources, one directory per model
        self.hf_root = hf_root  # the node's download directory
        self.retry_base_s = retry_base_s  # failed/evicted models: first retry after this, then doubling
        self.stall_timeout_s = stall_timeout_s
        self.snapshot_service = snapshots  # the node's snapshot service, reported under status.snapshots
        self.pool = ThreadPoolExecutor(max_workers=max_loads, thread_name_prefix="agent-load")
        self.inflight: dict[tuple[str, str], Future[None]] = {}  # (daemon key, model name) -> its load
        self.resolved: dict[tuple[str, str, str], str] = {}  # (name, repo, revision) -> Hub snapshot dir
        self.resolving: dict[str, threading.Lock] = {}  # model name -> held while one job resolves it
        self.state = AgentState(books={key: DaemonBook() for key in self.daemons})
        self.wanted: list[WantedModel] = []
        self.heartbeat_s = float(DEFAULT_HEARTBEAT_S)
        self.lock = threading.Lock()
        self.wake = threading.Event()  # the reporter: report now
        self.changed = threading.Event()  # the reconciler: the spec changed or a load finished
        self.desired: dict[str, Any] | None = None  # this node's WeightCacheNode as last seen
        # Whether a pass has read the spec (or failed to): before that the status would list no
        # models, or a model the daemon took over at start as Loading (see report).
        self.passed = False
        # ... and as last seen by the reporter, from the watch or its own write (status and uid)
        self.seen: dict[str, Any] | None = None
        self.renewed = -float("inf")  # time.monotonic() of the last Lease renewal (or attempt)
        self.lease_held = False  # the last renewal succeeded

    @property
    def object_name(self) -> str:
        return wcn.object_name(self.cache, self.node)

    def fetch(self) -> dict[str, Any] | None:
        """This node's WeightCacheNode now (None until the operator created it)."""
        return fetch_node_object(self.client(), self.object_name)

    def reconcile(self, obj: dict[str, Any]) -> None:
        """One pass: start loads of what is wanted and missing, release what is no longer wanted,
        in every daemon.

        Local work only (no API calls); loads run on the pool, see settle().
        """
        generation = obj["metadata"].get("generation")
        spec = WeightCacheNodeSpec.model_validate(obj.get("spec") or {})
        self.heartbeat_s = float(spec.heartbeat_seconds)
        wanted = wanted_models(spec, self.host_root, self.pvc_root)
        with self.lock:
            self.wanted = wanted
            self.state.message = ""
            self.passed = True
            if generation != self.state.generation:  # spec changed: retry failures and evictions now
                for book in self.state.books.values():
                    book.failed.clear()
                    book.evicted.clear()
                    book.attempts.clear()
                    book.retry_at.clear()
                self.state.generation = generation
        self._reap()
        for key in self.daemons:
            self._reconcile_daemon(key, wanted)

    def daemon_index(self, key: str) -> int:
        """The daemon's place among the node's (by GPU UUID, as agent.state numbers them): which
        tensor-parallel shards it holds (cache.gpus.held_ranks)."""
        return sorted(self.daemons).index(key)

    def _reconcile_daemon(self, key: str, wanted: list[WantedModel]) -> None:
        daemon, book = self.daemons[key], self.state.books[key]
        entries = [e for w in wanted for e in shard_entries(w, self.daemon_index(key), len(self.daemons))]
        names = {e.name for e in entries}
        busy = {name for k, name in self.inflight if k == key}
        for name in sorted(set(self._loaded(key)) - names - busy):
            with self.lock:
                daemon_name = book.daemon_names.pop(name)
            daemon.remove_model(daemon_name)
            log.info("released %s%s (removed from WeightCacheNode %s)", name, _on(key), self.object_name)
        resident = daemon.snapshot().models
        for entry in entries:
            w = entry.wanted
            if (key, entry.name) in self.inflight:
                continue
            daemon_name = self._loaded(key).get(entry.name)
            if daemon_name is None and self._book_handed_over(key, entry, resident):
                continue
            if daemon_name in resident:
                if w.pin and not resident[daemon_name].pinned:  # no-op reload; marks pinned
                    daemon.add_model(self._path(w), **load_options(w, entry.rank))
                continue
            if daemon_name is not None:  # was loaded, now gone: evicted under the budget
                with self.lock:
                    book.daemon_names.pop(entry.name)
                    book.evicted.add(entry.name)
                    self._schedule_retry(book, entry.name)
            retry_at = book.retry_at.get(entry.name)
            if retry_at is not None and now() < retry_at:
                continue  # failed or evicted: wait for the backoff
            if self._downloading_elsewhere(key, w):
                continue  # reported Loading; the next pass after that download loads it from disk
            with self.lock:
                book.loading.add(entry.name)
            self.inflight[(key, entry.name)] = self.pool.submit(self._load, key, entry)
            self.wake.set()  # report Loading now

    def _book_handed_over(self, key: str, entry: Entry, resident: Mapping[str, ModelSnapshot]) -> bool:
        """A model the daemon already holds from the same directory, though this agent never loaded
        it: the arena its predecessor or the holder handed over at start (cache/adopt.py verified
        it). Booked through the same add_model a load makes, which finds it resident (headers and
        key only, no weights read), so the status goes on saying Resident through an upgrade or a
        restart instead of Loading. Hub sources are not known by directory before their download:
        they take the usual way (reported Loading until that no-op load returns)."""
        w = entry.wanted
        if w.path is None or not any(str(m.path) == os.path.realpath(w.path) for m in resident.values()):
            return False
        try:
            daemon_name = self.daemons[key].add_model(self._path(w), **load_options(w, entry.rank))
        except Exception as exc:  # no longer what the spec asks for: the usual load reports why
            log.info("%s%s: the arena handed over does not serve it (%s); loading", entry.name, _on(key), exc)
            return False
        with self.lock:
            self.state.books[key].daemon_names[entry.name] = daemon_name
        log.info("%s%s is resident from the start (handed over)", entry.name, _on(key))
        return True

    def _downloading_elsewhere(self, key: str, w: WantedModel) -> bool:
        """Whether another daemon's job is downloading this Hub model now: this daemon waits for it
        without taking a pool worker (a hung download then holds one worker, not one per GPU)."""
        if w.repo is None or (w.name, w.repo, w.revision) in self.resolved:
            return False
        return any(k != key and name == w.name for k, name in self.inflight)

    def _loaded(self, key: str) -> dict[str, str]:
        """Model name -> daemon name in one daemon, copied under the lock (loads add to it)."""
        with self.lock:
            return dict(self.state.books[key].daemon_names)

    def settle(self, timeout_s: float | None = None) -> None:
        """Wait for the loads in flight (tests and shutdown; the loop itself never waits)."""
        wait(list(self.inflight.values()), timeout=timeout_s)
        self._reap()

    def _reap(self) -> None:
        for job, future in list(self.inflight.items()):
            if future.done():
                del self.inflight[job]

    def _schedule_retry(self, book: DaemonBook, name: str) -> None:
        """Caller holds the lock: one more failure in a row, next try after the backoff."""
        attempts = book.attempts.get(name, 0) + 1
        book.attempts[name] = attempts
        book.retry_at[name] = now() + dt.timedelta(seconds=retry_delay(attempts, self.retry_base_s))

    def _token(self, w: WantedModel) -> str | None:
        """The Hub token from its Secret in the agent's namespace, read through the API when needed."""
        if w.token is None:
            return None
        where = f"tokenSecretRef: Secret {self.namespace}/{w.token.name}"
        try:
            secret = self.client().get("v1", "Secret", w.token.name, self.namespace)
        except ApiError as exc:
            raise TokenSecretError(f"{where} could not be read ({exc.status} {exc.reason})") from exc
        if secret is None:
            raise TokenSecretError(f"{where} could not be read (404 NotFound)")
        data = secret.get("data") or {}
        if w.token.key not in data:
            raise TokenSecretError(f"{where} has no key {w.token.key!r}")
        return base64.b64decode(data[w.token.key]).decode().strip()

    def _path(self, w: WantedModel) -> str:
        """The directory to load: the path source, or the Hub snapshot, downloaded once for all
        daemons (one job downloads, see _downloading_elsewhere; the lock covers a race; a failure is
        that job's own, and the next load downloads again)."""
        if w.path is not None:
            return w.path
        assert w.repo is not None and w.revision is not None  # a Hub source (wanted_models)
        with self.lock:
            resolving = self.resolving.setdefault(w.name, threading.Lock())
        source = (w.name, w.repo, w.revision)
        with resolving:
            if source not in self.resolved:
                hf_dir, token = hf_cache_dir(self.hf_root), self._token(w)
                self.resolved[source] = download(w.repo, w.revision, hf_dir, token, self.stall_timeout_s)
            return self.resolved[source]

    def _load(self, key: str, entry: Entry) -> None:
        book, w, name = self.state.books[key], entry.wanted, entry.name
        try:
            path = self._path(w)
            daemon_name = self.daemons[key].add_model(path, **load_options(w, entry.rank))
        except Exception as exc:  # a bad checkpoint fails this model, not the agent
            log.warning("loading %s%s failed: %s", name, _on(key), exc)
            self.resolved.pop((w.name, w.repo or "", w.revision or ""), None)  # a retry downloads again
            with self.lock:
                book.failed[name] = f"{type(exc).__name__}: {exc}"
                self._schedule_retry(book, name)
        else:
            with self.lock:
                book.daemon_names[name] = daemon_name
                book.failed.pop(name, None)
                book.evicted.discard(name)
                book.attempts.pop(name, None)
                book.retry_at.pop(name, None)
        finally:
            with self.lock:
                book.loading.discard(name)
            self.wake.set()
            self.changed.set()  # another pass: a load may have evicted another model

    def snapshots(self) -> dict[str, DaemonSnapshot]:
        """Every daemon's snapshot by its GPU UUID ("" for host.sock)."""
        return {key: daemon.snapshot() for key, daemon in self.daemons.items()}

    def report(self) -> bool:
        """Write the WeightCacheNode status if it changed (not its heartbeat stamp alone), once a pass
        has read the spec; False while the operator has not created the object yet."""
        if not self.passed:
            return True  # nothing before a pass: the status would not say what the node holds
        with self.lock:
            stored = None if self.seen is None else self.seen.get("status") or {}
            self.state.reporting_since = fresh_since(stored, self.state.reporting_since, now())
            status = node_status(self.state, self.snapshots(), self.wanted, __version__)
            status = status.model_copy(update={"snapshots": self.snapshot_rows()})
        if not status_differs(stored, status):
            return True
        try:
            self.seen = self.client().merge_patch(
                API_VERSION, wcn.KIND, self.object_name, {"status": status.wire()}, status=True
            )
            return True
        except ApiError as exc:
            if exc.status == 404:
                log.info("WeightCacheNode %s not created yet; retrying", self.object_name)
                return False
            raise

    def snapshot_rows(self) -> list[wcn.NodeSnapshot]:
        """The store's snapshots, newest first (at most MAX_SNAPSHOTS_REPORTED); none without the
        snapshot service."""
        if self.snapshot_service is None:
            return []
        rows = sorted(self.snapshot_service.rows(), key=lambda e: e.created, reverse=True)
        return [
            wcn.NodeSnapshot(
                key=e.digest,
                bytes=e.bytes,
                created=dt.datetime.fromtimestamp(e.created, dt.UTC),
                restores=e.usage.restores,
            )
            for e in rows[: wcn.MAX_SNAPSHOTS_REPORTED]
        ]

    def client(self) -> Kube:
        """The client (a NodeAgent made without one is a test's that never calls the API)."""
        if self.kube is None:
            raise RuntimeError("this NodeAgent was made without a Kubernetes client")
        return self.kube

    def renew(self) -> bool:
        """Renew this node's Lease (create it, owned by the WeightCacheNode, on the first renewal or
        after the garbage collector removed it with an old WeightCacheNode). False while there is no
        WeightCacheNode yet: nothing to be stale."""
        self.renewed = time.monotonic()
        owner = self.seen or self.desired
        if owner is None:
            return False
        duration = int(wcn.STALE_HEARTBEATS * self.heartbeat_s)
        kube, renewal = self.client(), node_lease.renewal(now(), self.node, duration)
        try:
            kube.merge_patch(
                node_lease.LEASE_API_VERSION, node_lease.LEASE_KIND, self.object_name, renewal, self.namespace
            )
        except ApiError as exc:
            if exc.status != 404:
                raise
            body = node_lease.node_lease(
                self.object_name, self.namespace, self.cache, self.node, duration, now(), owner
            )
            # Created by apply, as the client's field manager (keepwarm-agent): one call, whoever is first.
            kube.apply(body)
        return True

    def _follow(self, obj: dict[str, Any] | None) -> None:
        self.desired = obj
        self.seen = obj
        self.changed.set()

    def run_watch(self, stop: threading.Event) -> None:
        """List this node's WeightCacheNode, then watch it from that list's resourceVersion; when the
        server ends the watch (its timeout) or answers 410 Gone (the version is too old), list and
        watch again; after any other error, the same a little later."""
        kube, selector = self.client(), by_name(self.object_name)
        while not stop.is_set():
            try:
                listing = kube.listing(API_VERSION, wcn.KIND, fields=selector)
                self._follow(listing.items[0] if listing.items else None)  # fetch(), keeping the version
                for kind, obj in kube.watch(API_VERSION, wcn.KIND, listing.resource_version, fields=selector):
                    if stop.is_set():
                        return
                    if kind in ("ADDED", "MODIFIED"):
                        self._follow(obj)
                    elif kind == "DELETED":
                        self._follow(None)
            except Exception as exc:  # API hiccups must not end the watch
                if isinstance(exc, ApiError) and exc.status == GONE:
                    log.info("watch of WeightCacheNode %s expired; listing again", self.object_name)
                    continue
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
            due = [
                (t - now()).total_seconds() for b in self.state.books.values() for t in b.retry_at.values()
            ]
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
                self.passed = True  # the failure is what the status says
            self.wake.set()
            self.changed.wait(self._next_pass_s())
        self.wake.set()
        self.pool.shutdown(wait=False, cancel_futures=True)


def _on(key: str) -> str:
    """ " on GPU-..." for a log line about one GPU's daemon; nothing for the host tier's one."""
    return f" on {key}" if key else ""


def report_start_failure(settings: CacheServeSettings, message: str) -> None:
    """Write why this node's daemon could not start onto its WeightCacheNode (start_failure_status)
    before the process exits: the pod's log says it too, but a platform engineer reads the node
    object. Best effort: a failure here is logged, never raised over the daemon's own error."""
    name = wcn.object_name(settings.weightcache, settings.node_name)
    try:
        kube = _kube()
        if (stored := fetch_node_object(kube, name)) is None:
            log.warning("WeightCacheNode %s not created yet; the start failure is only in this log", name)
            return
        status = wcn.start_failure_status(stored.get("status"), message, now())
        kube.merge_patch(API_VERSION, wcn.KIND, name, {"status": status}, status=True)
    except Exception as exc:  # no API, no permission: the log line above stands
        log.warning("could not report the start failure on WeightCacheNode %s: %s", name, exc)


def run_agent(
    daemons: list[Any],
    settings: CacheServeSettings,
    stop: threading.Event | None = None,
    snapshots: SnapshotService | None = None,
) -> None:
    """Entry point for `keepwarm cache serve --report-to-kubernetes` (runs until the daemons stop)."""
    try:
        kube = _kube()
    except AgentDependencyError as exc:
        log.error("%s", exc)
        return
    stop = stop or getattr(daemons[0], "_stop", None) or threading.Event()  # SIGTERM stops them all
    node_agent(daemons, settings, kube, snapshots).run(stop)


def node_agent(
    daemons: list[Any],
    settings: CacheServeSettings,
    kube: Kube | None,
    snapshots: SnapshotService | None = None,
) -> NodeAgent:
    """The NodeAgent of `keepwarm cache serve`'s resolved settings (its node agent flags and their
    variables: NODE_NAME, POD_NAMESPACE, KEEPWARM_*_ROOT); it reads no environment of its own."""
    return NodeAgent(
        daemons, settings.weightcache, settings.node_name, kube,
        namespace=settings.namespace, host_root=settings.host_model_root, pvc_root=settings.model_root,
        hf_root=settings.download_root, max_loads=settings.max_loads, stall_timeout_s=settings.stall_timeout,
        snapshots=snapshots,
    )  # fmt: skip
