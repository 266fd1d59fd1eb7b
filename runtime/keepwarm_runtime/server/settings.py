"""`keepwarm serve`'s settings, declared once (keepwarm_api.settings generates flags, KEEPWARM_* variables,
--help and the README's table from this class).

Every setting is ``--flag`` and ``KEEPWARM_<FIELD>`` (``max_num_seqs``: ``--max-num-seqs``,
``KEEPWARM_MAX_NUM_SEQS``; MODEL_DIR: ``KEEPWARM_MODEL_DIR``); a flag wins over its variable, and an
empty variable means the default. The "engine" group is handed to EngineConfig as keyword arguments:
left unset (None), a field keeps EngineConfig's own default, so that default is stated only there.
Imports stay light: `keepwarm --help` must not pay for torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from keepwarm_api.settings import setting
from keepwarm_api.values import CacheMode
from keepwarm_runtime.server.base.limits import (
    DEFAULT_FETCH_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_MEDIA_BYTES,
    DEFAULT_PREPROCESS_TIMEOUT_S,
)
from keepwarm_runtime.server.base.lora_modules import LoraModule, parse_lora_module
from keepwarm_runtime.server.openai.chat.tool_parsers import TOOL_PARSERS

ENGINE = "engine"  # the group of settings passed to EngineConfig


def engine(default: None, help: str) -> Any:
    """An engine setting: unset, EngineConfig's own default applies (stated only there)."""
    return setting(default, help, group=ENGINE, unset="the engine's")


@dataclass(frozen=True)
class ServeSettings:
    model_dir: str | None = setting(None, "Hugging Face checkpoint directory", positional=True, required=True)
    host: str = setting("0.0.0.0", "bind address")
    port: int = setting(8000, "port")
    served_model_name: str | None = setting(None, "name clients use in `model`", unset="the directory name")
    # the node weight cache (the operator sets these variables on pods; cache/env.py reads the same ones
    # for library users of attach())
    cache_socket_dir: str | None = setting(
        None, "node weight cache socket directory; unset: load weights from disk", group=ENGINE
    )
    cache_mode: str = setting(
        CacheMode.ZERO_COPY.value,
        "attach cached weights zero-copy or copy",
        choices=tuple(m.value for m in CacheMode),
        group=ENGINE,
    )
    cache_fallback: bool = setting(
        True, "fall back to disk when the cache cannot serve the model", group=ENGINE
    )
    cache_trusted_uids: frozenset[int] = setting(
        frozenset(),
        "a uid besides this process's and root's that may own the cache's socket and run its daemon",
        group=ENGINE,
        flag="--cache-trusted-uid",
        metavar="UID",
    )
    # the node's CPU kernel builds (the operator sets the variable on CPU pods; engine/attention/native.py)
    kernel_cache: str | None = setting(
        None, "read-only folder of CPU attention kernel builds (the node agent's) to load before building one"
    )
    # the engine (unset: EngineConfig's default)
    dtype: str | None = engine(
        None,
        "weights/activations dtype: float32 | bfloat16 | float16 | auto (the checkpoint's; bfloat16 on "
        "CPUs with amx_bf16/avx512_bf16) (engine: float32)",
    )
    device: str | None = engine(None, "cpu, cuda, cuda:1, ... (engine: cpu)")
    max_num_seqs: int | None = engine(None, "most sequences in one batch")
    max_num_batched_tokens: int | None = engine(None, "most tokens in one forward pass")
    max_model_len: int | None = engine(None, "context length (unset: the model's, capped by the KV cache)")
    block_size: int | None = engine(None, "tokens per KV-cache block")
    num_kv_blocks: int | None = engine(None, "KV-cache blocks (unset: sized from memory)")
    kv_cache_memory_gib: float | None = engine(
        None, "CPU KV-cache budget in GiB when --num-kv-blocks is unset"
    )
    gpu_memory_utilization: float | None = engine(None, "CUDA: fraction of GPU memory for weights + KV cache")
    attention_backend: str | None = engine(None, "auto | torch | cpu | flashinfer")
    moe_backend: str | None = engine(None, "experts: auto | torch | flashinfer_cutlass | flashinfer_trtllm")
    expert_layout: str | None = engine(
        None, "model | flashinfer_cutlass: experts in that kernel's layout (ask the cache for the same)"
    )
    quantization: str | None = engine(
        None, "fp8: quantize a float checkpoint online in 128x128 blocks (FP8 checkpoints load as-is)"
    )
    seed: int | None = engine(None, "seed for requests that set none")
    max_prompt_logprobs_len: int | None = engine(
        None, "longest prompt whose prompt logprobs (or echo with logprobs) a request may ask for"
    )
    # LoRA adapters (server/openai/lora/serving.py, engine/lora)
    enable_lora: bool | None = engine(
        None,
        "serve LoRA adapters (on by itself with --lora-modules, --lora-modules-file or "
        "--allow-runtime-lora-updating)",
    )
    max_loras: int | None = engine(None, "LoRA adapter slots: most distinct adapters in one batch")
    max_lora_rank: int | None = engine(None, "highest LoRA rank an adapter may have")
    lora_modules: tuple[LoraModule, ...] = setting(
        (),
        "a LoRA adapter clients name in `model`: name=path, or JSON {name, path, base_model_name} "
        "(repeat the flag; the variable takes name=path entries separated by commas)",
        parse=parse_lora_module,
        metavar="NAME=PATH",
    )
    lora_modules_file: str | None = setting(
        None,
        "a JSON list of LoRA adapters ({name, path} objects), re-read while serving: an adapter added "
        "there loads and a removed one unloads once idle, with no restart (the operator's ConfigMap)",
        metavar="PATH",
    )
    allow_runtime_lora_updating: bool = setting(
        False, "enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's runtime updating)"
    )
    # audio
    audio_backend: str | None = setting(
        None, "audio decoder: auto (torchcodec, then soundfile, then pyav) | torchcodec | soundfile | pyav"
    )
    max_audio_upload_bytes: int = setting(
        DEFAULT_MAX_MEDIA_BYTES, "largest /v1/audio/* upload or fetched chat audio_url; bigger ones get 413"
    )
    allowed_media_domains: str | None = setting(
        None, "comma-separated hosts whose http(s) chat audio_url the server may fetch", unset="none"
    )
    allowed_local_media_path: str | None = setting(
        None, "directory whose files chat audio_url file: URLs may read", unset="none"
    )
    media_fetch_timeout: float = setting(
        DEFAULT_FETCH_TIMEOUT_S, "seconds one audio_url fetch may take, redirects included"
    )
    # requests
    api_key: str | None = setting(
        None,
        "require `Authorization: Bearer <key>` on every route but /health, /ready, /ping and /metrics "
        "(prefer the variable: flags show in ps)",
    )
    max_request_body_bytes: int = setting(
        DEFAULT_MAX_BODY_BYTES, "larger request bodies get 413 before they are read"
    )
    trust_request_chat_template: bool = setting(
        False, "let requests send their own chat template (it runs in this process)"
    )
    tool_call_parser: str | None = setting(
        None,
        "how to recognise tool calls in the model's text (needed for tool_choice auto)",
        choices=sorted(TOOL_PARSERS),
    )
    preprocess_timeout: float = setting(
        DEFAULT_PREPROCESS_TIMEOUT_S, "seconds one request may spend preparing its prompt"
    )
    # the process
    threads: int | None = setting(
        None,
        "intra-op CPU threads (see engine/threads.py)",
        unset="the CPUs this process may use: affinity mask and cgroup CPU quota",
    )
    # sleep mode (server/openai/sleep/serving.py)
    enable_sleep_mode: bool = setting(
        False, "serve POST /sleep?level=1|2, POST /wake_up and GET /is_sleeping (vLLM's sleep mode)"
    )
    wake_on_request: bool = setting(
        False, "with sleep mode: a request to a sleeping engine wakes it (else 503 model_sleeping)"
    )
    # the supervising parent (server/supervisor.py)
    supervise: bool = setting(
        True,
        "run the server as a worker forked by a parent that imported everything ahead and re-forks it "
        "when it dies or hangs (--no-supervise: one process)",
    )
    supervisor_port: int | None = setting(
        None, "port of the parent's own /health (the liveness probe's)", unset="--port + 1"
    )
    worker_health_timeout: float = setting(
        10.0, "seconds the worker's /health may go unanswered before the parent restarts it"
    )
    max_failed_restarts: int = setting(
        5, "failed worker restarts in a row after which the parent's /health answers 503"
    )
    # the HTTP server
    uvicorn_log_level: str = setting("info", "uvicorn's log level")
    access_log: bool = setting(False, "log every request (uvicorn's access log)")
