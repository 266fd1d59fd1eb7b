"""Attach the weights in a background thread while the rest of start-up imports.

`keepwarm serve` spends seconds importing transformers' model classes (and uvicorn, fastapi) before
the engine can build its model; the weights need none of that, only torch, the checkpoint and, to
plan merges, quantization and layouts, a meta-device model of its config. ``WeightPrefetch.start``
runs ``attach()`` (the node cache, or the disk) in a daemon thread from the first moment the server
knows its settings: the one EngineConfig it builds, and hands to the engine too. The engine's loader
then takes that result instead of attaching again (``take``), provided its config asks for the same
attach (``AttachSettings``).

What an engine asks ``attach()`` for is one AttachRequest (``attach_request``), resolved from the
EngineConfig and the checkpoint alone, never from the model the engine builds: the online FP8
settings of ``--quantization fp8`` from config.json's ``quantization_config``
(``weights.quantization.online_settings``, the daemon's own answer), and the kernel layout of
``--expert-layout`` from a meta-device model built from config.json, as the arena's plan builds it
(``weights.kernel_layout.checkpoint_layout``). So the thread asks exactly the key and plan the loader
would, for every text checkpoint. Neither depends on the device: the expert layout is the user's setting,
never chosen from the GPU or the kernels it has (those choose the MoE backend, after the load), so
the request needs no CUDA probe; the attach itself finds a GPU's daemon socket from ``device``.
On a GPU (``--device cuda``, a gpu-tier daemon) the same request is made from this thread; that
path is untested on GPU (written without one: tests/gpu/moe/test_fp8_online_cache_gpu.py has its
test), its CPU twins are the prefetch tests of tests/integration/engine/test_fp8_online_cache.py
and test_moe_kernel_layout_cache.py.
A speech (Whisper) checkpoint is loaded by its own engine (audio/whisper_engine.py), so nothing is
attached for it here (the server passes the kind it detected: keepwarm_runtime.model_kind).
Nothing here imports torch at module level, so the server can start the thread before its own
imports begin; the meta-model build in the thread holds ``weights.serving_layout.BUILD_LOCK``, as
the engine's own build does, so the two never interleave torch's process-wide default dtype, and
every other tensor the attach makes (arena, staging, quantization) names its dtype, so the engine's
build holding that default meanwhile changes nothing here.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from keepwarm_runtime.model_kind import ModelKind

if TYPE_CHECKING:
    from keepwarm_runtime.cache.client import AttachResult
    from keepwarm_runtime.engine.config import EngineConfig
    from keepwarm_runtime.weights.quantization import Fp8Settings
    from keepwarm_runtime.weights.tensor_parallel import Sharding

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttachSettings:
    """The EngineConfig fields an attach is resolved from: equal settings, equal AttachRequest."""

    model_dir: str
    socket_dir: str | None  # the node cache's socket directory; None: from disk
    dtype: str  # serving dtype
    device: str
    mode: str  # a CacheMode
    fallback: bool  # a cache miss loads from disk
    trusted_uids: frozenset[int]  # uids besides ours and root's that may own the socket
    quantization: str | None  # "fp8": quantized online (a float checkpoint)
    expert_layout: str  # asked for; resolved per checkpoint by attach_request
    sharding: Sharding  # this rank's slice of the model (weights.tensor_parallel)

    @classmethod
    def of(cls, config: EngineConfig) -> AttachSettings:
        return cls(
            config.model_dir,
            config.cache_socket_dir,
            config.dtype,
            config.device,
            config.cache_mode,
            config.cache_fallback,
            config.cache_trusted_uids,
            config.quantization,
            config.expert_layout,
            config.sharding,
        )


@dataclass(frozen=True)
class AttachRequest:
    """The ``attach()`` an engine makes, every input resolved before any model is built."""

    settings: AttachSettings
    online: Fp8Settings | None  # quantized at load (the key's `quantization`); None: served as stored
    expert_layout: str  # settings.expert_layout where it converts this checkpoint's experts, else model

    def arguments(self) -> dict[str, Any]:
        """``attach()``'s keyword arguments."""
        s = self.settings
        return {
            "model_dir": s.model_dir,
            "socket_dir": s.socket_dir,
            "dtype": s.dtype,
            "device": s.device,
            "mode": s.mode,
            "fallback": s.fallback,
            "trusted_uids": s.trusted_uids,
            "online": self.online,
            "expert_layout": self.expert_layout,
            "sharding": s.sharding,
        }


def resolve(settings: AttachSettings) -> AttachRequest:
    """The request of ``settings``: reads config.json, and builds a meta-device model only for a
    kernel expert layout. QuantizationError / ExpertLayoutError as the daemon would refuse them."""
    from keepwarm_runtime.weights.kernel_layout import checkpoint_layout
    from keepwarm_runtime.weights.quantization import online_settings

    online = online_settings(settings.model_dir, settings.quantization)
    return AttachRequest(settings, online, checkpoint_layout(settings.model_dir, settings.expert_layout))


def attach_request(config: EngineConfig) -> AttachRequest:
    """What ``config``'s engine attaches (the loader's, the background thread's, a wake's)."""
    return resolve(AttachSettings.of(config))


class WeightPrefetch:
    """One ``attach()`` running in a daemon thread; ``take(config)`` hands its result to the loader."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config  # what it attaches for: the server's one EngineConfig
        self._future: Future[AttachResult | None] = Future()
        self._request: AttachRequest | None = None  # what was attached; None: nothing (yet)

    @classmethod
    def start(cls, config: EngineConfig, kind: ModelKind) -> WeightPrefetch:
        """Begin attaching for ``config``, the engine config of a ``kind`` model."""
        prefetch = cls(config)
        threading.Thread(target=prefetch._run, args=(kind,), name="keepwarm-weights", daemon=True).start()
        return prefetch

    def _run(self, kind: ModelKind) -> None:
        try:
            if kind is ModelKind.SPEECH:
                self._future.set_result(None)
                return
            from keepwarm_runtime.cache.client import attach

            # A request that cannot be resolved leaves _request None: the loader resolves it again
            # and raises the same error there, as it would have without a prefetch.
            request = attach_request(self.config)
            self._request = request
            self._future.set_result(attach(**request.arguments()))
        except BaseException as exc:  # handed to the loader by take(), never lost in this thread
            self._future.set_exception(exc)

    def take(self, config: EngineConfig) -> tuple[AttachRequest, AttachResult] | None:
        """The request attached and its result if ``config`` asks for that attach (waiting for it if
        need be), else None. An attach that failed raises here, in the loader, as it would have there.
        Either way the prefetch lets go of what it attached: no second copy outlives this call."""
        self._future.exception()  # wait, whatever the outcome
        request, future = self._request, self._future
        self._request, self._future = None, Future()
        self._future.set_result(None)
        if request is None:
            return None
        if request.settings != AttachSettings.of(config):
            log.warning("prefetched weights do not match the engine's settings; attaching again")
            return None
        return request, future.result()
