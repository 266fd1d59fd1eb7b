"""What the supervising parent imports before it forks workers: all a worker imports to serve.

A worker forked after these imports starts with torch, transformers' attention registry and weight
conversions, the checkpoint's own modelling module, the engine and the server already in memory (and
FastAPI's lazy imports done, by one app built and dropped; uvicorn's loop and protocol classes;
transformers' table of checkpoint conversions built), so a restart pays none of those seconds.
Only imports and that pure-Python table happen here: no torch op, no CUDA call, no model built, no
tokenizer loaded (tokenizers' thread pool must not exist before a fork), so the parent stays one
thread (server/supervisor.py checks before each fork). The grammar stacks are not imported: only a
constrained request needs them.
"""

from __future__ import annotations

import importlib
import logging
import time

from keepwarm_runtime.model_kind import ModelKind

logger = logging.getLogger(__name__)
_preloaded: set[tuple[ModelKind, str]] = set()  # (kind, modelling module) this process preloaded


def model_class(model_dir: str) -> type:
    """The class the engine will build for ``model_dir`` (engine/loader.py's choice); resolving it
    imports its modelling module. KeyError for an architecture transformers has no causal LM for."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from keepwarm_runtime.engine.multimodal import model_class as audio_language_class

    hf_config = AutoConfig.from_pretrained(model_dir)
    return audio_language_class(hf_config) or MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]


def preload(model_dir: str, kind: ModelKind, cuda: bool = False) -> float:
    """Import the serving path of ``model_dir``'s checkpoint (a ``kind`` model; on CUDA also the
    FlashInfer backend); returns the seconds it took."""
    started = time.perf_counter()
    import torch  # noqa: F401
    import transformers.core_model_loading  # noqa: F401
    import uvicorn  # noqa: F401
    from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    import keepwarm_runtime.engine.llm_engine
    import keepwarm_runtime.server.app  # noqa: F401

    loaded = "-"
    if kind is ModelKind.SPEECH:
        importlib.import_module("keepwarm_runtime.audio.whisper_engine")
        loaded = "whisper"
    else:
        try:
            loaded = model_class(model_dir).__module__
        except (ImportError, OSError, ValueError, KeyError) as exc:  # the engine names a bad checkpoint
            logger.warning("preloading %s's model classes failed (%s); a worker imports them", model_dir, exc)
    if (kind, loaded) in _preloaded:  # a parent restored from a snapshot: it did all this before
        logger.info("the serving path is preloaded (model classes: %s)", loaded)
        return time.perf_counter() - started
    _warm_app_imports(model_dir)
    _import_serving_internals()
    if cuda:
        _import_cuda_attention()
    _build_conversion_table()
    _preloaded.add((kind, loaded))
    seconds = time.perf_counter() - started
    logger.info("preloaded the serving path in %.2fs (model classes: %s)", seconds, loaded)
    return seconds


def _warm_app_imports(model_dir: str) -> None:
    """Build and drop one app: FastAPI imports more on its first routes (pydantic.v1's compatibility
    layer, ~0.25 s here), which a worker would otherwise pay after each fork. Nothing is started."""
    from keepwarm_runtime.server.app import create_app

    app = create_app(lambda: None, model_dir=model_dir)  # never started: no engine, no threads
    app.state.ctx.close()


def _import_serving_internals() -> None:
    """What a worker would import only once it runs: uvicorn's event loop and protocol classes (its
    "auto" choices: uvloop, httptools, ...), anyio's asyncio backend and the CPU attention backend.
    Imports only; nothing is created. The grammar stacks stay out: only a constrained request needs them."""
    from uvicorn.config import HTTP_PROTOCOLS, LIFESPAN, LOOP_FACTORIES, WS_PROTOCOLS
    from uvicorn.importer import import_from_string

    for target in (HTTP_PROTOCOLS["auto"], WS_PROTOCOLS["auto"], LIFESPAN["auto"], LOOP_FACTORIES["auto"]):
        if target is not None:
            import_from_string(target)
    import_from_string(LOOP_FACTORIES["auto"])()  # picks (imports) uvloop or asyncio; makes no loop
    import anyio._backends._asyncio  # noqa: F401

    import keepwarm_runtime.engine.attention.cpu_backend  # noqa: F401


def _import_cuda_attention() -> None:
    """FlashInfer's Python package and keepwarm's backend over it (seconds of a CUDA worker's
    `attention` phase otherwise): imports only, no kernel loaded and no CUDA call, so no context. Its
    JIT modules load at the worker's warm-up, after the fork. Untested on GPU in CI (scripts/gpu-check
    runs tests/gpu/snapshot, which checks the parent stays one thread without a CUDA context)."""
    try:
        import keepwarm_runtime.engine.attention.flashinfer_backend  # noqa: F401
    except ImportError as exc:  # no flashinfer-python (extra `gpu`): the worker takes the torch backend
        logger.info("not preloading FlashInfer: %s", exc)


def _build_conversion_table() -> None:
    """transformers builds its table of checkpoint conversions, for every architecture at once (~1,000
    regular expressions, 0.2-0.4 s on a small CPU), on the loader's first use; built here, every worker
    inherits it. Pure Python: no tensor, no thread."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # an older transformers without conversion mappings (engine/loader.py)
        return
    get_checkpoint_conversion_mapping("llama")  # any name: the first call builds the whole table
