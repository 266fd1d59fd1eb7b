"""Attach the weights in a background thread while the rest of start-up imports.

`keepwarm serve` spends seconds importing transformers' model classes (and uvicorn, fastapi) before
the engine can build its model; the weights need none of that, only torch and the checkpoint's
safetensors headers. ``WeightPrefetch.start`` runs ``attach()`` (the node cache, or the disk) in a
daemon thread from the first moment the server knows its settings: the one EngineConfig it builds,
and hands to the engine too. The engine's loader then takes that result instead of attaching again
(``take``), provided it asks for exactly the same attach (``attach_arguments`` is the one definition
of that request for both).

Only plain attaches of causal LMs are prefetched: with ``--quantization fp8`` or a kernel
``--expert-layout`` what the cache is asked for depends on the built model, so the loader attaches
itself; a speech (Whisper) checkpoint is loaded by its own engine (audio/whisper_engine.py), so
nothing is attached for it here (the server passes the kind it detected: keepwarm_runtime.model_kind).
Nothing here imports torch at module level, so the server can start the thread before its own
imports begin.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from keepwarm_runtime.model_kind import ModelKind
from keepwarm_runtime.weights.layouts import MODEL

if TYPE_CHECKING:
    from keepwarm_runtime.cache.client import AttachResult
    from keepwarm_runtime.engine.config import EngineConfig

log = logging.getLogger(__name__)


def attach_arguments(config: EngineConfig) -> dict[str, Any]:
    """``attach()`` keyword arguments of an engine without online quantization (the loader's own)."""
    return {
        "model_dir": config.model_dir,
        "socket_dir": config.cache_socket_dir,
        "dtype": config.torch_dtype,
        "device": config.device,
        "mode": config.cache_mode,
        "fallback": config.cache_fallback,
    }


class WeightPrefetch:
    """One ``attach()`` running in a daemon thread; ``take(config)`` hands its result to the loader."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config  # what it attaches for: the server's one EngineConfig
        self._future: Future[AttachResult | None] = Future()
        self._arguments: dict[str, Any] | None = None  # what was attached; None: nothing (yet)

    @classmethod
    def start(cls, config: EngineConfig, kind: ModelKind) -> WeightPrefetch:
        """Begin attaching for ``config``, the engine config of a ``kind`` model."""
        prefetch = cls(config)
        threading.Thread(target=prefetch._run, args=(kind,), name="keepwarm-weights", daemon=True).start()
        return prefetch

    def _run(self, kind: ModelKind) -> None:
        try:
            from keepwarm_runtime.cache.client import attach

            config = self.config
            # Online FP8 and kernel expert layouts key the arena by what the built model holds: the
            # loader attaches those itself, once it has the model.
            converted = config.quantization is not None or config.expert_layout != MODEL
            if converted or kind is ModelKind.SPEECH:
                self._future.set_result(None)
                return
            self._arguments = attach_arguments(config)
            self._future.set_result(attach(**self._arguments))
        except BaseException as exc:  # handed to the loader by take(), never lost in this thread
            self._future.set_exception(exc)

    def take(self, config: EngineConfig) -> AttachResult | None:
        """The attached weights if they are what ``config`` would attach (waiting for them if need
        be), else None. An attach that failed raises here, in the loader, as it would have there.
        Either way the prefetch lets go of what it attached: no second copy outlives this call."""
        self._future.exception()  # wait, whatever the outcome
        arguments, future = self._arguments, self._future
        self._arguments, self._future = None, Future()
        self._future.set_result(None)
        if arguments is None:
            return None
        if arguments != attach_arguments(config):
            log.warning("prefetched weights do not match the engine's settings; attaching again")
            return None
        return future.result()
