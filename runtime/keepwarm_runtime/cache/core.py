"""The daemon core: one cache daemon's state and the operations on it, without sockets or hand-offs.

``DaemonCore`` holds what a daemon serves (the registry of resident models, failed loads, metrics,
peer policy, lock and listener) and changes it (``add_model``, ``remove_model``, reloads of a model
changed on disk, ``snapshot``). The parts around it use it and it imports none of them: the request
handlers (handlers.py), the connection loop (connections.py), the hand-off (succession.py, adopt.py),
the holder's side of the daemon (holder_link.py) and the daemon that composes them (daemon.py), which
also overrides ``sync_holder``, the one hook called after every change of the resident set.

Nothing here imports torch: keying a checkpoint (fingerprint.py) and re-checking a resident model read
only headers, identities and config.json (weights/files.py). A model that must be read from disk is
planned and filled by loading.py, imported on the first such load; so a daemon whose models were all
adopted (from a predecessor or the holder) answers its clients before torch is imported, and may never
import it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from keepwarm_api.sockets import HOST_SOCKET, gpu_socket_name
from keepwarm_api.values import SERVING_DTYPES, Tier
from keepwarm_runtime import __version__
from keepwarm_runtime.cache import security
from keepwarm_runtime.cache.adapters import KIND_ADAPTER, KIND_MODEL, KINDS, adapter_file, adapter_key
from keepwarm_runtime.cache.backends.host import ArenaSealError
from keepwarm_runtime.cache.fingerprint import WeightCacheKey, compute_key
from keepwarm_runtime.cache.limits import ServerLimits
from keepwarm_runtime.cache.metrics import DaemonMetrics
from keepwarm_runtime.cache.registry import ModelRegistry, ResidentModel
from keepwarm_runtime.cache.settings import TIERS
from keepwarm_runtime.cache.snapshot import DaemonSnapshot, FailedModel
from keepwarm_runtime.weights.files import ShardFile, read_shard_files
from keepwarm_runtime.weights.layouts import MODEL, conversion_id
from keepwarm_runtime.weights.quantization import Fp8Settings, online_settings
from keepwarm_runtime.weights.tensor_parallel import WHOLE, Sharding

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
    """ "auto" asks torch whether CUDA is present (the only start-up path that imports torch)."""
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; use {', '.join(TIERS)}")
    if tier != "auto":
        return tier
    import torch

    return Tier.GPU.value if torch.cuda.is_available() else Tier.HOST.value


def serving_dtype(name: str) -> str:
    if name not in SERVING_DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use {', '.join(SERVING_DTYPES)}")
    return name


def socket_name(serves_gpu: str | None) -> str:
    """gpu-<UUID>.sock for the daemon of one GPU (the name cache.client looks for), else host.sock."""
    return gpu_socket_name(serves_gpu) if serves_gpu else HOST_SOCKET


class DaemonCore:
    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.tier = resolve_tier(config.tier)
        self.dtype = serving_dtype(config.dtype)  # a name; loading.py makes it a torch dtype
        self.conversion = conversion_id(config.expert_layout)  # an unknown layout stops the daemon here
        self.gpu_uuid: str | None = None
        self.device_ordinal = 0
        if self.tier == "gpu":
            from keepwarm_runtime.cache.backends import cuda  # the driver only: no torch yet

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
        self.policy = security.PeerPolicy(allow_uids=config.allow_uids, allow_gids=config.allow_gids)
        self.refusals = security.RefusalLog()  # peers the policy refused, for the node agent
        self.lock = security.DaemonLock(self.socket_path)
        self.listener: socket.socket | None = None  # the socket it serves, once bound (daemon.py)
        self.handed_off = False  # this daemon handed its arenas and socket to a successor
        self.handing_off = threading.Lock()  # held while a successor holds a stream of this daemon
        self.started_at = time.time()
        self._load_lock = threading.Lock()
        self._failed: dict[str, FailedModel] = {}
        self._reloading: set[str] = set()  # names being reloaded after a change on disk
        self._failed_lock = threading.Lock()
        self._stop = threading.Event()

    # -- the resident set -----------------------------------------------------------------------

    def add_model(
        self,
        path: str | Path,
        pin: bool = False,
        evict: bool = True,
        quantization: str | None = None,
        kind: str = KIND_MODEL,
        sharding: Sharding = WHOLE,
    ) -> str:
        """Load ``path`` (once; a second call with the same settings is a no-op) and return its name.

        ``sharding``: one tensor-parallel rank's shard of the model (weights.tensor_parallel), an arena
        of its own named ``<model>.tp<rank>of<size>`` (registry.shard_name), keyed by its rank and size.

        ``evict=False`` (the initial models) refuses a model that does not fit the budget instead
        of evicting another. ``quantization="fp8"`` quantizes a float checkpoint online into the
        arena (``loader.plan_layout``); an FP8 checkpoint or another method is refused by name.
        ``kind="adapter"`` loads a PEFT LoRA adapter directory as stored (cache/adapters.py): no
        quantization or layout conversion applies to it. A model already resident with the key its
        files have now (one that was adopted, say) is found from headers and identities alone, without
        torch. On failure the model is recorded as Failed and the error re-raised.
        """
        if kind not in KINDS:
            raise ValueError(f"unknown kind {kind!r}; use {' or '.join(KINDS)}")
        path = Path(path).resolve()
        if kind == KIND_ADAPTER and sharding.sharded:
            raise ValueError("LoRA adapters are held whole, never as tensor-parallel shards")
        name = self.registry.unique_name(path, sharding)
        try:
            with self._load_lock:
                current = self.registry.get(name)
                if current is not None and self._still_resident(current, path, kind, quantization, sharding):
                    current.pinned = current.pinned or pin
                else:
                    self._load(path, name, pin, evict, quantization, kind, sharding)
        except Exception as exc:
            self._record_failure(name, path, exc)
            raise
        with self._failed_lock:
            self._failed.pop(name, None)
        with contextlib.suppress(KeyError):  # it had not failed before
            self.metrics.failed_models.remove(name)
        self.sync_holder()
        return name

    def _still_resident(
        self, current: ResidentModel, path: Path, kind: str, quantization: str | None, sharding: Sharding
    ) -> bool:
        """``current`` holds ``path`` as it is now, in these settings (headers, identities, config.json)."""
        if kind == KIND_ADAPTER:
            return current.key == adapter_key(path, self.dtype, [adapter_file(path)])
        online = online_settings(path, quantization)
        return current.key in self.model_keys(path, read_shard_files(path), online, sharding)

    def model_keys(
        self, path: Path, shards: list[ShardFile], online: Fp8Settings | None, sharding: Sharding
    ) -> tuple[WeightCacheKey, WeightCacheKey]:
        """The key of ``path``'s arena (``sharding``'s shard) in this daemon's expert layout, and the
        key it takes when that layout converts none of its experts (dense, gpt-oss): the model
        layout's. Headers, identities and config.json only: no torch."""
        conversion = conversion_id(self.config.expert_layout, sharding)
        rank, size = sharding.rank, sharding.size
        key = compute_key(path, self.dtype, rank, size, shards=shards, conversion=conversion, online=online)
        return key, replace(key, conversion=conversion_id(MODEL, sharding))

    def _load(
        self,
        path: Path,
        name: str,
        pin: bool,
        evict: bool,
        quantization: str | None,
        kind: str,
        sharding: Sharding = WHOLE,
    ) -> None:
        """Read ``path`` into a new sealed arena and serve it (loading.py: the first use of torch)."""
        from keepwarm_runtime.cache import loading

        if kind == KIND_ADAPTER:
            plan = loading.plan_adapter(path, self.dtype)
        else:
            plan = loading.plan_model(path, self.dtype, quantization, self.config.expert_layout, sharding)
        for victim in self.registry.reserve(self._arena_bytes(plan.size), keep=name, evict=evict):
            self._drop(victim, "evicted for --budget")
            self.metrics.evictions.inc()
        started = time.perf_counter()
        arena = self._new_arena(name, plan.size)
        try:
            digest = loading.fill(arena, plan)
        except BaseException:
            arena.close()
            raise
        model = ResidentModel(
            name,
            path,
            plan.key,
            plan.tensors(),
            arena,
            self.tier,
            digest,
            pin or name in self.config.pins or path.name in self.config.pins,
            time.perf_counter() - started,
            list(plan.shards),
            gpu_uuid=self.gpu_uuid,
            quantization=plan.quantization,
            kind=kind,
            sharding=sharding,
            filled=plan.layout,
        )
        self._install(model)
        if kind == KIND_ADAPTER:
            log.info(
                "loaded adapter %s (%d tensors, %.2f MiB %s) in %.3fs",
                name,
                len(model.tensors),
                model.nbytes / 2**20,
                self.tier,
                model.load_seconds,
            )
            return
        log.info(
            "loaded %s (%d tensors%s, %.2f GiB %s, %s pages) in %.2fs",
            name,
            len(model.tensors),
            plan.notes,
            model.nbytes / 2**30,
            self.tier,
            arena.page_mode,
            model.load_seconds,
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
            self.add_model(
                model.path,
                pin=model.pinned,
                quantization=model.quantization,
                kind=model.kind,
                sharding=model.sharding,
            )
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

    def _arena_bytes(self, size: int) -> int:
        """What an arena for ``size`` bytes of tensors takes on this tier: whole VMM granules on a GPU,
        whole huge pages for a large host arena."""
        if self.tier == "gpu":
            from keepwarm_runtime.cache.backends.cuda import arena_bytes as gpu_arena_bytes

            return gpu_arena_bytes(size, self.device_ordinal)
        from keepwarm_runtime.cache.backends.host import arena_bytes

        return arena_bytes(size)

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

    def sync_holder(self) -> None:
        """Called after every change of the resident set; daemon.py deposits it with the holder."""

    # -- serving state --------------------------------------------------------------------------

    def handoff_fds(self) -> list[int]:
        """The listener and lock descriptors a successor takes over."""
        if self.listener is None or self.lock.fd is None:
            raise OSError("this daemon is not serving")
        return [self.listener.fileno(), self.lock.fd]

    def hand_over(self) -> None:
        """The successor committed: stop accepting; open connections finish (SocketServer drains)."""
        self.handed_off = True
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def stop(self) -> None:
        """Ask ``serve_forever`` to return (safe from a signal handler)."""
        self._stop.set()
