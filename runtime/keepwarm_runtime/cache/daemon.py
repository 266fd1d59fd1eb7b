"""The cache daemon: loads checkpoints once, holds them in a tier, serves them over a Unix socket.

``CacheDaemon`` is also the in-process API of the node agent (``add_model``, ``remove_model``,
``snapshot`` are thread-safe). Start order: ``claim`` (socket directory and lock; when another daemon
holds the lock, take its arenas over instead, before loading anything: succession.py; after a crash,
take back what the descriptor holder kept: holder.py), load the initial models it still lacks,
``bind`` (after a take-over: commit, and serve the predecessor's own listener), ``serve_forever``; a
client that can connect can attach, and one ``READY`` line on stderr says so.

``--adapter`` (and ``add_model(kind="adapter")``) loads a PEFT LoRA adapter directory the same way,
laid out as stored (cache/adapters.py): none of the model conversions (online FP8, expert layouts)
apply to it; clients attach it with ``client.attach_adapter``.

A model that fails to load (bad shard, no room under the budget, unsealable arena) is ``Failed`` with
a reason naming the file, in ``stats``/``list`` and metrics; it never costs a resident model its
place, because every header is validated before anything is evicted. A resident model whose shard
changes on disk is never served again: the next request that touches it is a miss and starts a
reload in the background, which replaces it (or, failing, drops it and marks it Failed).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from keepwarm_api.sockets import HOST_SOCKET, gpu_socket_name
from keepwarm_api.values import Tier
from keepwarm_runtime import __version__
from keepwarm_runtime.cache import holder, security, succession
from keepwarm_runtime.cache.adapters import (
    KIND_ADAPTER,
    KIND_MODEL,
    KINDS,
    adapter_key,
    adapter_layout,
    read_adapter,
)
from keepwarm_runtime.cache.connections import SocketServer
from keepwarm_runtime.cache.fingerprint import WeightCacheKey, compute_key
from keepwarm_runtime.cache.handlers import CommandHandlers
from keepwarm_runtime.cache.limits import ServerLimits, raise_nofile_limit
from keepwarm_runtime.cache.metrics import ARENA_SOURCES, DaemonMetrics
from keepwarm_runtime.cache.registry import ModelRegistry, ResidentModel
from keepwarm_runtime.cache.settings import TIERS
from keepwarm_runtime.cache.snapshot import DaemonSnapshot, FailedModel
from keepwarm_runtime.cache.succession import Inheritance
from keepwarm_runtime.weights.arena import ArenaLayout, fill_arena, plan_layout
from keepwarm_runtime.weights.checkpoint import Shard, parse_dtype, read_checkpoint
from keepwarm_runtime.weights.kernel_layout import MODEL, conversion_id
from keepwarm_runtime.weights.quantization import online_settings

log = logging.getLogger(__name__)
MAX_REASON_CHARS = 1000  # a Failed model's reason, as reported in stats, list and the node status


@dataclass
class DaemonConfig:
    socket_dir: Path
    tier: str = "auto"  # "auto" (gpu when CUDA is present) | "gpu" | "host"
    device: str = "cuda:0"  # gpu tier: which GPU
    dtype: str = "bfloat16"  # serving dtype of floating tensors
    budget: int | None = None  # bytes; LRU-evict unpinned models beyond it
    pins: frozenset[str] = frozenset()  # model names (directory names) never evicted
    group: str | None = None  # socket dir 0770 / socket 0660 with this group
    allow_uids: frozenset[int] = frozenset()
    allow_gids: frozenset[int] = frozenset()  # matched against primary and supplementary groups
    metrics_port: int | None = None
    limits: ServerLimits = field(default_factory=ServerLimits)
    quantization: str | None = None  # "fp8": quantize the --model checkpoints online at load
    expert_layout: str = MODEL  # MoE experts converted at load to this kernel's layout (kernel_layout)
    # Test/dev twin of one GPU (`--fake-gpus`): host-memory arenas served on gpu-<UUID>.sock, so a
    # machine without CUDA runs the gpu tier's per-GPU daemons; host tier only (the arenas are host).
    fake_gpu_uuid: str | None = None


def resolve_tier(tier: str) -> str:
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; use {', '.join(TIERS)}")
    if tier != "auto":
        return tier
    import torch

    return Tier.GPU.value if torch.cuda.is_available() else Tier.HOST.value


def socket_name(serves_gpu: str | None) -> str:
    """gpu-<UUID>.sock for the daemon of one GPU (the name cache.client looks for), else host.sock."""
    return gpu_socket_name(serves_gpu) if serves_gpu else HOST_SOCKET


class CacheDaemon:
    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.tier = resolve_tier(config.tier)
        self.dtype = parse_dtype(config.dtype)
        self.conversion = conversion_id(config.expert_layout)  # an unknown layout stops the daemon here
        self.gpu_uuid: str | None = None
        self.device_ordinal = 0
        if self.tier == "gpu":
            from keepwarm_runtime.cache.backends import cuda

            self.device_ordinal = cuda.device_ordinal(config.device)
            self.gpu_uuid = cuda.gpu_uuid(self.device_ordinal)
            if config.fake_gpu_uuid:
                raise ValueError("a fake GPU is host memory; the gpu tier serves real GPUs only")
        # The GPU whose pods this daemon serves: the arenas' GPU, or the twin's fake one (whose arenas
        # are host memory, so its replies name no gpu_uuid).
        self.serves_gpu = self.gpu_uuid or config.fake_gpu_uuid
        self.socket_dir = Path(config.socket_dir)
        self.socket_path = self.socket_dir / socket_name(self.serves_gpu)
        security.check_socket_path(self.socket_path)  # before any model is loaded
        self.registry = ModelRegistry(config.budget)
        self.metrics = DaemonMetrics()
        self.metrics.resident_adapters.set_function(
            lambda: sum(m.kind == KIND_ADAPTER for m in self.registry.models())
        )
        self.handlers = CommandHandlers(self)
        self.policy = security.PeerPolicy(allow_uids=config.allow_uids, allow_gids=config.allow_gids)
        self.refusals = security.RefusalLog()  # peers the policy refused, for the node agent
        self._gid = security.resolve_gid(config.group)
        self._load_lock = threading.Lock()
        self._failed: dict[str, FailedModel] = {}
        self._reloading: set[str] = set()  # names being reloaded after a change on disk
        self._failed_lock = threading.Lock()
        self._stop = threading.Event()
        self.lock = security.DaemonLock(self.socket_path)
        self._listener: socket.socket | None = None
        self._inheritance: Inheritance | None = None  # from a predecessor, until bind() commits it
        self.handed_off = False  # this daemon handed its arenas and socket to a successor
        self.took_over = False  # this daemon serves a predecessor's socket (bind committed it)
        self.handing_off = threading.Lock()  # held while a successor holds a stream of this daemon
        self._holder_lock = threading.Lock()
        self._nofile = 0
        self.started_at = time.time()

    # -- node agent API -------------------------------------------------------------------------

    def add_model(
        self,
        path: str | Path,
        pin: bool = False,
        evict: bool = True,
        quantization: str | None = None,
        kind: str = KIND_MODEL,
    ) -> str:
        """Load ``path`` (once; a second call with the same settings is a no-op) and return its name.

        ``evict=False`` (the initial models) refuses a model that does not fit the budget instead
        of evicting another. ``quantization="fp8"`` quantizes a float checkpoint online into the
        arena (``loader.plan_layout``); an FP8 checkpoint or another method is refused by name.
        ``kind="adapter"`` loads a PEFT LoRA adapter directory as stored (cache/adapters.py): no
        quantization or layout conversion applies to it. On failure the model is recorded as Failed
        and the error re-raised.
        """
        if kind not in KINDS:
            raise ValueError(f"unknown kind {kind!r}; use {' or '.join(KINDS)}")
        path = Path(path).resolve()
        name = self.registry.unique_name(path)
        try:
            with self._load_lock:
                if kind == KIND_ADAPTER:
                    name = self._load_adapter(path, name, pin, evict)
                else:
                    name = self._load(path, name, pin, evict, quantization)
        except Exception as exc:
            self._record_failure(name, path, exc)
            raise
        with self._failed_lock:
            self._failed.pop(name, None)
        with contextlib.suppress(KeyError):  # it had not failed before
            self.metrics.failed_models.remove(name)
        self.sync_holder()
        return name

    def _load(self, path: Path, name: str, pin: bool, evict: bool, quantization: str | None) -> str:
        shards = read_checkpoint(path)  # validates every header before anything is evicted
        online = online_settings(path, quantization)
        key = compute_key(path, self.dtype, shards=shards, conversion=self.conversion, online=online)
        # A model the expert layout converts nothing in (dense, gpt-oss) is keyed in the model layout.
        unconverted = replace(key, conversion=conversion_id(MODEL))
        current = self.registry.get(name)
        if current is not None and current.key in (key, unconverted):
            current.pinned = current.pinned or pin
            return name
        pinned = pin or name in self.config.pins or path.name in self.config.pins
        layout = plan_layout(shards, self.dtype, online, self.config.expert_layout)
        if not layout.up_first:
            key = unconverted
        model = self._fill(name, path, key, layout, shards, pinned, evict)
        model.quantization = quantization if online is not None else None
        self._install(model)
        notes = f", {len(layout.quantized)} quantized to fp8 online" if online is not None else ""
        if layout.up_first:
            notes += f", {len(layout.up_first)} in the {self.config.expert_layout} layout"
        log.info(
            "loaded %s (%d tensors%s, %.2f GiB %s, %s pages) in %.2fs",
            name,
            len(layout.entries),
            notes,
            model.nbytes / 2**30,
            self.tier,
            model.arena.page_mode,
            model.load_seconds,
        )
        return name

    def _load_adapter(self, path: Path, name: str, pin: bool, evict: bool) -> str:
        """A LoRA adapter: its tensors as stored (floats in the serving dtype), keyed as an adapter."""
        shards = read_adapter(path)
        key = adapter_key(path, self.dtype, shards)
        current = self.registry.get(name)
        if current is not None and current.key == key:
            current.pinned = current.pinned or pin
            return name
        pinned = pin or name in self.config.pins or path.name in self.config.pins
        model = self._fill(name, path, key, adapter_layout(shards, self.dtype), shards, pinned, evict)
        model.kind = KIND_ADAPTER
        self._install(model)
        log.info(
            "loaded adapter %s (%d tensors, %.2f MiB %s) in %.3fs",
            name,
            len(model.layout.entries),
            model.nbytes / 2**20,
            self.tier,
            model.load_seconds,
        )
        return name

    def _fill(
        self,
        name: str,
        path: Path,
        key: WeightCacheKey,
        layout: ArenaLayout,
        shards: list[Shard],
        pinned: bool,
        evict: bool,
    ) -> ResidentModel:
        """Make room, then read ``shards`` into a new sealed arena laid out as ``layout``."""
        for victim in self.registry.reserve(layout.size, keep=name, evict=evict):
            self._drop(victim, "evicted for --budget")
            self.metrics.evictions.inc()
        started = time.perf_counter()
        arena = self._new_arena(name, layout.size)
        try:
            digest = fill_arena(arena, shards, layout)
            arena.seal()
        except BaseException:
            arena.close()
            raise
        seconds = time.perf_counter() - started
        return ResidentModel(
            name, path, key, layout, arena, self.tier, digest, pinned, seconds, shards, gpu_uuid=self.gpu_uuid
        )

    def _install(self, model: ResidentModel) -> None:
        """Serve ``model`` from now on, in place of an older version of the same name."""
        old = self.registry.remove(model.name)
        if old is not None:
            self._drop(old, "replaced by a new version")
        self.registry.insert(model)
        self.metrics.resident_bytes.labels(model.name, self.tier).set(model.nbytes)
        self.metrics.load_seconds.labels(model.name).set(model.load_seconds)

    def _record_failure(self, name: str, path: Path, exc: Exception) -> None:
        from keepwarm_runtime.cache.backends.host import ArenaSealError

        if isinstance(exc, ArenaSealError):
            self.metrics.seal_failures.inc()
        reason = str(exc) if str(path) in str(exc) else f"{path}: {exc}"
        with self._failed_lock:
            self._failed[name] = FailedModel(path, f"{type(exc).__name__}: {reason}"[:MAX_REASON_CHARS])
        self.metrics.failed_models.labels(name).set(1)

    def failed_models(self) -> dict[str, FailedModel]:
        with self._failed_lock:
            return dict(self._failed)

    def remove_model(self, name: str) -> bool:
        model = self.registry.remove(name)
        if model is None:
            return False
        self._drop(model, "released")
        return True

    def changed_on_disk(self, model: ResidentModel, changed: list[Path]) -> None:
        """Reload ``model`` in the background: its files are no longer what was loaded.

        Until the new version replaces it, every request for it is a miss (the handler re-checks
        the files before each hit); if the reload fails, the stale arena is dropped and the model
        is Failed. A model that is already reloading is left to that reload.
        """
        with self._failed_lock:
            if model.name in self._reloading:
                return
            self._reloading.add(model.name)
        self.metrics.changed_on_disk.inc()
        log.warning("%s changed on disk (%s); reloading", model.name, ", ".join(p.name for p in changed))
        threading.Thread(target=self._reload, args=(model,), daemon=True, name=f"reload-{model.name}").start()

    def _reload(self, model: ResidentModel) -> None:
        try:
            self.add_model(model.path, pin=model.pinned, quantization=model.quantization, kind=model.kind)
        except Exception:  # recorded as Failed by add_model; the stale bytes must go
            if self.registry.remove(model.name, model) is not None:
                self._drop(model, "changed on disk and the reload failed", level=logging.WARNING)
        finally:
            with self._failed_lock:
                self._reloading.discard(model.name)

    def snapshot(self) -> DaemonSnapshot:
        """Daemon state for the node agent and succession; its ``wire()`` is the ``stats`` reply."""
        return DaemonSnapshot(
            version=__version__,
            pid=os.getpid(),
            tier=self.tier,
            socket=self.socket_path,
            dtype=self.config.dtype,
            budget=self.config.budget,
            gpu_uuid=self.gpu_uuid,
            serves_gpu=self.serves_gpu,
            models={m.name: m.snapshot() for m in self.registry.models()},
            failed=self.failed_models(),
            refusals=self.refusals.latest(),
        )

    def _new_arena(self, name: str, size: int):
        if self.tier == "gpu":
            from keepwarm_runtime.cache.backends.cuda import CudaArena

            return CudaArena(name, size, self.device_ordinal)
        from keepwarm_runtime.cache.backends.host import HostArena

        return HostArena(name, size)

    def _drop(self, model: ResidentModel, why: str, level: int = logging.INFO) -> None:
        # Clients that mapped it keep their mapping: the kernel/driver frees it after the last unmap.
        model.arena.close()
        self.metrics.resident_bytes.remove(model.name, model.tier)
        log.log(level, "dropped %s (%s)", model.name, why)
        if not self.stopping:  # a daemon that stops leaves the holder its arenas, for its restart
            self.sync_holder()

    # -- socket server --------------------------------------------------------------------------

    def claim(self) -> None:
        """Prepare the socket directory and take the lock, or take everything over from the daemon
        holding it: call before loading anything, so that nothing resident is read again."""
        if self.lock.held or self._inheritance is not None:
            return
        security.prepare_socket_dir(self.socket_dir, self._gid)
        try:
            self.lock.acquire()
        except security.DaemonAlreadyRunning as busy:
            self._inheritance = succession.take_over(self, busy)
            if self._inheritance is not None:
                return
        holder.recover(self)  # after a crash: what the holder kept for this socket

    def sync_holder(self) -> None:
        """Give the holder (when one runs) this socket's current arenas, replacing what it kept."""
        if self._listener is None:
            return  # not serving yet: bind() syncs once the start-up loads are done
        with self._holder_lock:
            holder.deposit(self)

    def handoff_fds(self) -> list[int]:
        """The listener and lock descriptors a successor takes over."""
        if self._listener is None or self.lock.fd is None:
            raise OSError("this daemon is not serving")
        return [self._listener.fileno(), self.lock.fd]

    def hand_over(self) -> None:
        """The successor committed: stop accepting; open connections finish (SocketServer drains)."""
        self.handed_off = True
        self._stop.set()

    def bind(self) -> None:
        """Take the lock (if ``claim`` did not), clear a stale socket, bind and listen."""
        self.claim()
        self._nofile = raise_nofile_limit()
        if self._inheritance is not None:  # the predecessor's listener: no connection is ever refused
            inheritance, self._inheritance = self._inheritance, None
            self.took_over = True
            listener = socket.socket(fileno=inheritance.listener_fd)
            try:
                succession.commit(self, inheritance)
            except BaseException:
                listener.detach()  # commit closed the descriptor
                raise
        else:
            listener = security.bind_private(self.socket_path, self.lock)
        security.secure_socket_file(self.socket_path, self._gid)
        listener.listen(socket.SOMAXCONN)  # a restart storm of pods queues instead of failing
        listener.settimeout(0.2)
        self._listener = listener
        self.sync_holder()
        self._count_start()
        if self.config.metrics_port is not None:
            self.metrics.serve(self.config.metrics_port, took_over=self.took_over)

    def _count_start(self) -> None:
        """Where the arenas this daemon begins serving came from (keepwarm_cache_start_arenas): a
        start that read everything from disk although a predecessor or the holder had it shows here."""
        origins = [m.origin for m in self.registry.models()]
        for source in ARENA_SOURCES:
            self.metrics.start_arenas.labels(source).set(origins.count(source))

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def serve_forever(self) -> None:
        if self._listener is None:
            self.bind()
        names = ",".join(m.name for m in self.registry.models()) or "-"
        print(
            f"READY keepwarm cache socket={self.socket_path} tier={self.tier} models={names} "
            f"pid={os.getpid()}",
            file=sys.stderr,
            flush=True,
        )
        try:
            SocketServer(self, self._listener, self.config.limits, self._nofile).serve(self._stop)
        finally:
            self.close()

    def stop(self) -> None:
        """Ask ``serve_forever`` to return (safe from a signal handler)."""
        self._stop.set()

    def close(self) -> None:
        if self._inheritance is not None:  # never committed: the predecessor keeps serving
            inheritance, self._inheritance = self._inheritance, None
            inheritance.sock.close()
            os.close(inheritance.listener_fd)
            os.close(inheritance.lock_fd)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            if self.lock.held and not self.handed_off:  # a successor serves this socket now
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.socket_path)
        self.lock.release()
        self._stop.set()  # so that dropping the arenas leaves the holder's copies alone
        for model in self.registry.models():
            if self.handed_off:  # the successor holds its own descriptors: nothing is released
                self.registry.remove(model.name)
                model.arena.close()
            else:
                self.remove_model(model.name)
