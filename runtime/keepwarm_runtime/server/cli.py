"""`keepwarm serve MODEL_DIR`: the OpenAI-compatible server.

Flags, KEEPWARM_* variables and --help come from one declaration, ``server/settings.py``
(``--max-num-seqs`` <- ``KEEPWARM_MAX_NUM_SEQS``; MODEL_DIR <- ``KEEPWARM_MODEL_DIR``); a flag on the
command line wins, an empty variable means the default. This is how the operator configures pods.
The parsed arguments become one ServeSettings here, at the entry point; everything below takes that.
Imports stay lazy: `keepwarm --help` must not pay for torch.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from collections.abc import Mapping
from typing import Any

from keepwarm_api.settings import SettingError, add_command, env_names, group, resolve
from keepwarm_runtime.engine.auto_dtype import AUTO_DTYPE, auto_dtype
from keepwarm_runtime.server.settings import ENGINE, ServeSettings

logger = logging.getLogger(__name__)


def serve_env_vars() -> frozenset[str]:
    """Every environment variable `keepwarm serve` reads."""
    return env_names(ServeSettings)


def register(subparsers: argparse._SubParsersAction) -> None:
    add_serve_parser(subparsers)


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return add_command(
        subparsers, "serve", ServeSettings, "serve MODEL_DIR over an OpenAI-compatible HTTP API", run
    )


def serve_settings(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> ServeSettings:
    """The one ServeSettings of this process: flags, else KEEPWARM_* variables, else defaults.

    A value that does not parse (or a missing MODEL_DIR) is a SystemExit naming the flag or variable."""
    try:
        return resolve(ServeSettings, args, environ)
    except SettingError as exc:
        raise SystemExit(f"keepwarm serve: {exc}") from None


def engine_settings(settings: ServeSettings) -> dict[str, Any]:
    """EngineConfig keyword arguments: the engine group's set fields (unset ones keep its defaults).

    ``--dtype auto`` becomes a dtype here (engine/auto_dtype.py), so everything that takes these
    settings (the engine, the speech engine, the weight loader) sees a real one; the choice is logged.
    """
    engine = group(settings, ENGINE)
    if engine.get("dtype") == AUTO_DTYPE and settings.model_dir is not None:
        engine["dtype"], why = auto_dtype(settings.model_dir, engine.get("device"))
        logger.info("--dtype auto: %s (%s)", engine["dtype"], why)
    return engine


def run(args: argparse.Namespace) -> int:
    """The handler of `keepwarm serve`: resolve the settings once, then serve them."""
    try:
        settings = serve_settings(args)
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return 2
    return serve(settings)


def serve(config: ServeSettings) -> int:
    """Load the model in the background and serve until stopped; 2 on bad settings, 1 if loading fails."""
    from keepwarm_runtime.engine import threads as cpu_threads

    # Before anything imports torch: OpenMP reads its thread count and wait policy once, at load.
    try:
        thread_choice = cpu_threads.choose_threads(config.threads)
    except ValueError as exc:
        print(f"keepwarm serve: {exc}", file=sys.stderr)
        return 2
    openmp_prepared = cpu_threads.prepare_openmp(thread_choice)
    from keepwarm_runtime.server.metrics import process_start_time

    started_at = process_start_time()
    assert config.model_dir is not None  # required: resolve() refuses settings without it
    if not os.path.isdir(config.model_dir):
        print(f"keepwarm serve: {config.model_dir} is not a directory", file=sys.stderr)
        return 2
    settings = engine_settings(config)
    if config.lora_modules or config.allow_runtime_lora_updating:
        settings.setdefault("enable_lora", True)
    model_dir = os.path.abspath(config.model_dir)
    from keepwarm_runtime.engine.prefetch import WeightPrefetch

    # The weights need only torch: attach them while the server and transformers import.
    prefetch = WeightPrefetch.start(model_dir, settings)
    import uvicorn

    from keepwarm_runtime.server.app import create_app
    from keepwarm_runtime.server.media_fetch import media_policy
    from keepwarm_runtime.server.serving import ServingOptions
    from keepwarm_runtime.server.serving_audio import audio_settings, make_speech_engine

    try:
        media = media_policy(
            config.allowed_media_domains,
            config.allowed_local_media_path,
            config.max_audio_upload_bytes,
            config.media_fetch_timeout,
        )
        audio = audio_settings(config.audio_backend, config.max_audio_upload_bytes, model_dir, media)
    except (ValueError, RuntimeError) as exc:
        print(f"keepwarm serve: {exc}", file=sys.stderr)
        return 2

    def make_engine() -> Any:
        # transformers resolves its names lazily: import what the engine uses now (the attention
        # registry and weight conversions pull torch._dynamo, torch.distributed.tensor and sympy, ~4 s
        # on a small CPU), so those seconds are charged to the imports phase, not to config.
        import transformers.core_model_loading  # noqa: F401
        from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401

        from keepwarm_runtime.engine.config import EngineConfig
        from keepwarm_runtime.engine.llm_engine import LLMEngine
        from keepwarm_runtime.engine.startup import StartupProfile

        speech = make_speech_engine(model_dir, settings)
        if speech is not None:
            return speech
        profile = StartupProfile.since_process_start(started_at)
        profile.mark("imports")
        engine = LLMEngine(EngineConfig(model_dir, **settings), profile, prefetch)
        for adapter in config.lora_modules:  # a bad adapter fails the start, naming it
            engine.add_lora(adapter.name, adapter.path)
        engine.warm_up()
        return engine

    options = ServingOptions(
        trust_request_chat_template=config.trust_request_chat_template,
        tool_call_parser=config.tool_call_parser,
        preprocess_timeout_s=config.preprocess_timeout,
        max_request_body_bytes=config.max_request_body_bytes,
        api_key=config.api_key or None,
        lora_modules=config.lora_modules,
        allow_runtime_lora_updating=config.allow_runtime_lora_updating,
    )
    app = create_app(
        make_engine,
        model_dir=model_dir,
        served_model_name=config.served_model_name,
        started_at=started_at,
        options=options,
        audio=audio,
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=config.uvicorn_log_level,
            access_log=config.access_log,
            timeout_graceful_shutdown=5,
        )
    )
    async_engine = app.state.ctx.async_engine

    def stop_if_load_fails() -> None:
        async_engine.ready_event.wait()
        if async_engine.state == "failed":
            logger.error("exiting: the model could not be loaded (%s)", async_engine.error)
            server.should_exit = True

    threading.Thread(target=stop_if_load_fails, name="keepwarm-load-watch", daemon=True).start()
    logger.info(
        "intra-op threads: %d (%s; torch reports %d)%s",
        thread_choice.threads,
        thread_choice.reason,
        cpu_threads.apply(thread_choice),
        "" if openmp_prepared else "; torch was imported first, so OpenMP's wait policy is its default",
    )
    logger.info(
        "serving %s on http://%s:%d (engine settings: %s, api key %s)",
        model_dir,
        config.host,
        config.port,
        settings,
        "required" if options.api_key else "off",
    )
    server.run()
    return 1 if async_engine.state == "failed" else 0
