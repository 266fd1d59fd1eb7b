"""`keepwarm serve MODEL_DIR`: the OpenAI-compatible server.

Every flag also comes from an environment variable, ``KEEPWARM_`` + the flag in upper snake case
(``--max-num-seqs`` <- ``KEEPWARM_MAX_NUM_SEQS``; MODEL_DIR <- ``KEEPWARM_MODEL_DIR``); a flag on the
command line wins. This is how the operator configures pods. Imports stay lazy: `keepwarm --help`
must not pay for torch.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from keepwarm_runtime.cache.env import env_flag
from keepwarm_runtime.server.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_PREPROCESS_TIMEOUT_S
from keepwarm_runtime.server.tool_parsers import TOOL_PARSERS

logger = logging.getLogger(__name__)


# Engine settings: (flag, type, help). Unset ones keep EngineConfig's defaults.
ENGINE_FLAGS: list[tuple[str, Callable[[str], Any], str]] = [
    ("--dtype", str, "weights/activations dtype: float32 | bfloat16 | float16 (engine default: float32)"),
    ("--device", str, "cpu, cuda, cuda:1, ... (engine default: cpu)"),
    ("--max-num-seqs", int, "most sequences in one batch"),
    ("--max-num-batched-tokens", int, "most tokens in one forward pass"),
    ("--max-model-len", int, "context length (default: the model's, capped by the KV cache)"),
    ("--block-size", int, "tokens per KV-cache block"),
    ("--num-kv-blocks", int, "KV-cache blocks (default: sized from memory)"),
    ("--kv-cache-memory-gib", float, "CPU KV-cache budget in GiB when --num-kv-blocks is unset"),
    ("--gpu-memory-utilization", float, "CUDA: fraction of GPU memory for weights + KV cache"),
    ("--attention-backend", str, "auto | torch | flashinfer"),
    (
        "--moe-backend",
        str,
        "experts: auto | torch | flashinfer_cutlass | flashinfer_trtllm (engine.moe.oracle)",
    ),
    (
        "--quantization",
        str,
        "fp8: quantize a float checkpoint online in 128x128 blocks (FP8 checkpoints load as-is)",
    ),
    ("--seed", int, "seed for requests that set none"),
]


def env_name(flag: str) -> str:
    return "KEEPWARM_" + flag.lstrip("-").replace("-", "_").upper()


def serve_env_vars() -> set[str]:
    """Every environment variable `keepwarm serve` reads."""
    serve = add_serve_parser(argparse.ArgumentParser().add_subparsers())
    return {
        env_name("--" + action.dest.replace("_", "-")) for action in serve._actions if action.dest != "help"
    }


def _env(flag: str, kind: Callable[[str], Any], default: Any = None) -> Any:
    if kind is bool:  # the one rule for boolean KEEPWARM_* values, shared with the cache client
        try:
            return env_flag(env_name(flag), default)
        except ValueError as exc:
            raise SystemExit(f"keepwarm serve: {exc}") from None
    raw = os.environ.get(env_name(flag))
    if raw is None or not raw.strip():
        return default
    try:
        return kind(raw)
    except ValueError:
        raise SystemExit(f"keepwarm serve: {env_name(flag)}={raw!r} is not a valid {kind.__name__}") from None


def register(subparsers: argparse._SubParsersAction) -> None:
    add_serve_parser(subparsers)


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL_DIR over an OpenAI-compatible API. Every flag also reads KEEPWARM_<FLAG>.",
    )
    p.add_argument(
        "model_dir",
        nargs="?",
        default=_env("--model-dir", str),
        help="Hugging Face checkpoint directory (env KEEPWARM_MODEL_DIR)",
    )
    p.add_argument("--host", default=_env("--host", str, "0.0.0.0"), help="bind address (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=_env("--port", int, 8000), help="port (default 8000)")
    p.add_argument(
        "--served-model-name",
        default=_env("--served-model-name", str),
        help="name clients use in `model` (default: the directory name)",
    )
    p.add_argument(
        "--cache-socket-dir",
        default=_env("--cache-socket-dir", str),
        help="node weight cache socket directory; unset: load weights from disk",
    )
    p.add_argument(
        "--cache-mode",
        choices=["zero_copy", "copy"],
        default=_env("--cache-mode", str, "zero_copy"),
        help="attach cached weights zero-copy (default) or copy them",
    )
    p.add_argument(
        "--cache-fallback",
        action=argparse.BooleanOptionalAction,
        default=_env("--cache-fallback", bool, True),
        help="fall back to disk when the cache cannot serve the model (default: on)",
    )
    for flag, kind, text in ENGINE_FLAGS:
        p.add_argument(flag, type=kind, default=_env(flag, kind), help=text)
    p.add_argument(
        "--audio-backend",
        default=_env("--audio-backend", str),
        help="audio decoder: auto (torchcodec, then soundfile, then pyav) | torchcodec | soundfile | pyav",
    )
    p.add_argument(
        "--max-audio-upload-bytes",
        type=int,
        default=_env("--max-audio-upload-bytes", int, 25 * 1024 * 1024),
        help="largest /v1/audio/* upload; bigger ones get 413 (default 25 MiB)",
    )
    p.add_argument(
        "--api-key",
        default=_env("--api-key", str),
        help="require `Authorization: Bearer <key>` on every route but /health, /ready, /ping and /metrics "
        "(prefer the env KEEPWARM_API_KEY: flags show in ps)",
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=_env("--max-request-body-bytes", int, DEFAULT_MAX_BODY_BYTES),
        help=f"larger request bodies get 413 before they are read (default {DEFAULT_MAX_BODY_BYTES})",
    )
    p.add_argument(
        "--trust-request-chat-template",
        action=argparse.BooleanOptionalAction,
        default=_env("--trust-request-chat-template", bool, False),
        help="let requests send their own chat template (it runs in this process; default: refused)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=_env("--tool-call-parser", str),
        help="how to recognise tool calls in the model's text (needed for tool_choice auto)",
    )
    p.add_argument(
        "--preprocess-timeout",
        type=float,
        default=_env("--preprocess-timeout", float, DEFAULT_PREPROCESS_TIMEOUT_S),
        help=f"seconds one request may spend preparing its prompt (default {DEFAULT_PREPROCESS_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=_env("--threads", int),
        help="intra-op CPU threads (default: the CPUs this process may use, from its affinity mask and "
        "cgroup CPU quota; see engine/threads.py)",
    )
    p.add_argument("--uvicorn-log-level", default=_env("--uvicorn-log-level", str, "info"))
    p.add_argument(
        "--access-log", action=argparse.BooleanOptionalAction, default=_env("--access-log", bool, False)
    )
    p.set_defaults(handler=run)
    return p


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig keyword arguments from parsed args (unset engine flags omitted)."""
    settings: dict[str, Any] = {
        "cache_socket_dir": args.cache_socket_dir,
        "cache_mode": args.cache_mode,
        "cache_fallback": args.cache_fallback,
    }
    for flag, _, _ in ENGINE_FLAGS:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            settings[flag.lstrip("-").replace("-", "_")] = value
    return settings


def run(args: argparse.Namespace) -> int:
    from keepwarm_runtime.engine import threads as cpu_threads

    # Before anything imports torch: OpenMP reads its thread count and wait policy once, at load.
    try:
        thread_choice = cpu_threads.choose_threads(args.threads)
    except ValueError as exc:
        print(f"keepwarm serve: {exc}", file=sys.stderr)
        return 2
    openmp_prepared = cpu_threads.prepare_openmp(thread_choice)
    from keepwarm_runtime.server.metrics import process_start_time

    started_at = process_start_time()
    if not args.model_dir:
        print("keepwarm serve: give MODEL_DIR (or set KEEPWARM_MODEL_DIR)", file=sys.stderr)
        return 2
    if not os.path.isdir(args.model_dir):
        print(f"keepwarm serve: {args.model_dir} is not a directory", file=sys.stderr)
        return 2
    import uvicorn

    from keepwarm_runtime.server.app import create_app
    from keepwarm_runtime.server.serving import ServingOptions

    settings = engine_settings(args)
    model_dir = os.path.abspath(args.model_dir)
    from keepwarm_runtime.server.serving_audio import audio_settings, make_speech_engine

    try:
        audio = audio_settings(args.audio_backend, args.max_audio_upload_bytes, model_dir)
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
        engine = LLMEngine(EngineConfig(model_dir, **settings), profile)
        engine.warm_up()
        return engine

    options = ServingOptions(
        trust_request_chat_template=args.trust_request_chat_template,
        tool_call_parser=args.tool_call_parser,
        preprocess_timeout_s=args.preprocess_timeout,
        max_request_body_bytes=args.max_request_body_bytes,
        api_key=args.api_key or None,
    )
    app = create_app(
        make_engine,
        model_dir=model_dir,
        served_model_name=args.served_model_name,
        started_at=started_at,
        options=options,
        audio=audio,
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            access_log=args.access_log,
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
        args.host,
        args.port,
        settings,
        "required" if options.api_key else "off",
    )
    server.run()
    return 1 if async_engine.state == "failed" else 0
