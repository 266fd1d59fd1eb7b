"""`keepwarm serve`'s settings, declared once (keepwarm_api.settings generates flags, KEEPWARM_* variables,
--help and the reference pages' tables from this class).

Every setting is ``--flag`` and ``KEEPWARM_<FIELD>`` (``max_num_seqs``: ``--max-num-seqs``,
``KEEPWARM_MAX_NUM_SEQS``; MODEL_DIR: ``KEEPWARM_MODEL_DIR``); a flag wins over its variable, and an
empty variable means the default. The "engine" group is handed to EngineConfig as keyword arguments:
left unset (None), a field keeps EngineConfig's own default, so that default is stated only there.
vLLM's command line is spoken here too: a setting that is vLLM's own flag says ``shared=True`` (or
names vLLM's spelling in ``aliases``), and ``FOREIGN_FLAGS`` answers the `vllm serve` flags keepwarm
takes no setting for: accepted where keepwarm already behaves so, refused by name with what to use
instead (docs/reference/vllm.md is generated from this class).
Imports stay light: `keepwarm --help` must not pay for torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from keepwarm_api.foreign import Foreign, accepted, refused
from keepwarm_api.settings import setting
from keepwarm_api.values import CacheMode, DType
from keepwarm_runtime.server.base.limits import (
    DEFAULT_FETCH_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_MEDIA_BYTES,
    DEFAULT_PREPROCESS_TIMEOUT_S,
)
from keepwarm_runtime.server.base.lora_modules import LoraModule, parse_lora_module
from keepwarm_runtime.server.openai.chat.tool_parsers import TOOL_PARSERS

ENGINE = "engine"  # the group of settings passed to EngineConfig
# vLLM's other spellings of a dtype (its --dtype takes these too)
VLLM_DTYPES = {"half": DType.FLOAT16.value, "float": DType.FLOAT32.value}


def engine(default: None, help: str, **kwargs: Any) -> Any:
    """An engine setting: unset, EngineConfig's own default applies (stated only there)."""
    return setting(default, help, group=ENGINE, unset="the engine's", **kwargs)


def dtype_name(text: str) -> str:
    """A --dtype value: keepwarm's names, or vLLM's ``half`` and ``float``; the engine checks the name."""
    return VLLM_DTYPES.get(text.strip(), text.strip())


SAME_NODE = "run more replicas (an InferenceDeployment's spec.replicas); within one, --tensor-parallel-size"
SAME_NODE += " splits a model over the node's devices (and with --nnodes over several nodes)"
HUB = "MODEL_DIR is a local directory: a WeightCache's huggingFace source (repo, revision, tokenSecretRef)"
HUB += " downloads a Hub model on the node"

# `vllm serve` flags keepwarm takes no setting for (docs/reference/vllm.md).
VLLM_FOREIGN_FLAGS: tuple[Foreign, ...] = (
    refused("--model", instead="give the checkpoint directory as MODEL_DIR, as `vllm serve MODEL` does"),
    refused("--tokenizer", instead="the checkpoint directory's own tokenizer serves; put its files there"),
    refused("--revision", "--tokenizer-revision", "--code-revision", instead=HUB),
    refused("--download-dir", "--hf-token", instead=HUB),
    refused("--trust-remote-code", instead="keepwarm runs transformers' own modelling code only"),
    refused(
        "--load-format", instead="safetensors checkpoints, attached from the node cache or read from disk"
    ),
    refused("--pipeline-parallel-size", "-pp", instead=SAME_NODE),
    refused("--data-parallel-size", "-dp", instead=SAME_NODE),
    refused("--kv-cache-dtype", instead="the KV cache is kept in --dtype"),
    refused(
        "--kv-cache-memory-bytes",
        instead="--num-kv-blocks (any device), --kv-cache-memory-gib (CPU) or "
        "--gpu-memory-utilization (CUDA)",
    ),
    refused("--swap-space", "--cpu-offload-gb", instead="preempted sequences are recomputed, not swapped"),
    refused(
        "--no-enable-chunked-prefill",
        instead="chunked prefill is how the scheduler works: prompts share each step's "
        "--max-num-batched-tokens",
    ),
    refused("--max-logprobs", instead="the bound is fixed: 20 top logprobs per token"),
    refused(
        "--chat-template",
        instead="the checkpoint's own chat template serves; --trust-request-chat-template lets requests "
        "send theirs",
    ),
    refused(
        "--enable-log-requests", instead="request contents are never logged; --access-log logs each request"
    ),
    refused("--speculative-config", instead="no speculative decoding"),
    refused("--reasoning-parser", instead="no reasoning output (the Responses API refuses `reasoning`)"),
    refused(
        "--structured-outputs-config",
        "--guided-decoding-backend",
        instead="xgrammar serves, and llguidance for schemas xgrammar would not enforce exactly; no choice",
    ),
    refused(
        "--scheduling-policy",
        instead="requests are always scheduled by their `priority` (lower first), then by arrival",
    ),
    refused("--return-tokens-as-token-ids", instead="send `return_tokens_as_token_ids` in the request"),
    refused(
        "--max-cpu-loras", instead="registered adapters stay in host memory; --max-loras sets device slots"
    ),
    refused(
        "--lora-dtype", "--fully-sharded-loras", "--enable-lora-bias", instead="adapters compute in --dtype"
    ),
    refused(
        "--compilation-config",
        "-O",
        instead="no torch.compile; CUDA graphs for decode steps are on (--enforce-eager turns them off)",
    ),
    refused("--hf-overrides", "--rope-scaling", instead="edit the checkpoint's config.json"),
    refused(
        "--ssl-keyfile",
        "--ssl-certfile",
        "--ssl-ca-certs",
        instead="terminate TLS in front of the server (an Ingress, a gateway or a service mesh)",
    ),
    refused(
        "--allowed-origins",
        "--allowed-methods",
        "--allowed-headers",
        "--allow-credentials",
        instead="no CORS headers: put a proxy in front for browser clients",
    ),
    refused("--root-path", instead="serve behind a proxy that strips the path prefix"),
    refused("--middleware", instead="no extra ASGI middleware: put a proxy in front"),
    refused("--uds", instead="the server listens on TCP: --host and --port"),
    refused(
        "--limit-mm-per-prompt", instead="no count limit; --max-audio-upload-bytes bounds each audio input"
    ),
    refused("--config", instead="flags or KEEPWARM_* variables (one per flag)"),
    refused("--api-server-count", "-asc", instead=SAME_NODE),
    accepted("--enable-chunked-prefill", why="prompts are always prefilled in chunks"),
    accepted("--disable-log-requests", why="request contents are never logged"),
    accepted("--disable-log-stats", why="no periodic stats are logged; /metrics has them"),
    accepted(
        "--disable-uvicorn-access-log",
        why="no access log (keepwarm's default; --access-log turns it on)",
        sets=("access_log", False),
    ),
    accepted(
        "--enable-auto-tool-choice",
        why="tool_choice auto is served whenever --tool-call-parser is given (needed, as in vLLM)",
        requires="tool_call_parser",
    ),
)


@dataclass(frozen=True)
class ServeSettings:
    FOREIGN_PROGRAM: ClassVar[str] = "vLLM"
    FOREIGN_FLAGS: ClassVar[tuple[Foreign, ...]] = VLLM_FOREIGN_FLAGS

    model_dir: str | None = setting(None, "Hugging Face checkpoint directory", positional=True, required=True)
    host: str = setting("0.0.0.0", "bind address", shared=True)
    port: int = setting(8000, "port", shared=True)
    served_model_name: str | None = setting(
        None, "name clients use in `model`", unset="the directory name", shared=True
    )
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
        "CPUs with amx_bf16/avx512_bf16); vLLM's half and float too (engine: float32)",
        parse=dtype_name,
        shared=True,
    )
    device: str | None = engine(None, "cpu, cuda, cuda:1, ... (engine: cpu)", shared=True)
    max_num_seqs: int | None = engine(None, "most sequences in one batch", shared=True)
    max_num_batched_tokens: int | None = engine(None, "most tokens in one forward pass", shared=True)
    max_model_len: int | None = engine(
        None, "context length (unset: the model's, capped by the KV cache)", shared=True
    )
    block_size: int | None = engine(None, "tokens per KV-cache block", shared=True)
    num_kv_blocks: int | None = engine(
        None, "KV-cache blocks (unset: sized from memory)", aliases=("--num-gpu-blocks-override",)
    )
    kv_cache_memory_gib: float | None = engine(
        None, "CPU KV-cache budget in GiB when --num-kv-blocks is unset"
    )
    cpu_packed_weights: bool | None = engine(
        None,
        "CPU bfloat16 on AVX-512 BF16/AMX: keep oneDNN's packed copy of each linear weight, made in the "
        "background after load (faster steps, as much memory again as the linear layers; engine: on)",
    )
    cpu_amx_linear: bool | None = engine(
        None,
        "CPU bfloat16 on AMX: steps of up to 64 tokens multiply by the weights where they lie, on AMX tiles, "
        "instead of oneDNN (results may differ from it by one bfloat16 ulp; engine: on)",
    )
    cpu_bf16_linear: bool | None = engine(
        None,
        "CPU bfloat16 on AVX-512 BF16 without AMX: every step multiplies by the weights where "
        "they lie, on keepwarm's kernel instead of oneDNN's packed copy (results may differ by one "
        "bfloat16 ulp; engine: on)",
    )
    cpu_f32_linear: bool | None = engine(
        None,
        "CPU float32 on AVX-512: steps of up to 128 tokens multiply by the weights where they lie, on "
        "keepwarm's kernel instead of MKL (results may differ from it by float32 rounding; engine: on)",
    )
    cpu_fused_ops: bool | None = engine(
        None,
        "CPU: fused RMSNorm, SiLU- and GELU-tanh-and-mul and rotary kernels on the modules whose code is "
        "Llama's, Gemma's RMSNorm's, Phi-3's or GLM's (Mistral, Qwen, Gemma, SmolLM3, Granite and kin, "
        "found by their code; in float32 results may differ by float32 rounding; engine: on)",
    )
    gpu_memory_utilization: float | None = engine(
        None, "CUDA: fraction of GPU memory for weights + KV cache", shared=True
    )
    enforce_eager: bool | None = engine(
        None,
        "CUDA: launch every decode step from Python, no CUDA graphs (engine: graphs for decode steps "
        "with FlashInfer, captured per batch size while idle once ready, or on first use)",
        shared=True,
    )
    async_scheduling: bool | None = engine(
        None,
        "launch the next step before this one's tokens are landed, landing them while it runs (engine: on "
        "CUDA, off on CPU, where nothing overlaps; steps sampling with penalties, bad words, min_tokens, a "
        "constraint or prompt logprobs run one at a time)",
        shared=True,
    )
    enable_prefix_caching: bool | None = engine(
        None, "share KV blocks between requests with a common prompt prefix (engine: on)", shared=True
    )
    attention_backend: str | None = engine(None, "auto | torch | cpu | flashinfer")
    moe_backend: str | None = engine(None, "experts: auto | torch | flashinfer_cutlass | flashinfer_trtllm")
    expert_layout: str | None = engine(
        None, "model | flashinfer_cutlass: experts in that kernel's layout (ask the cache for the same)"
    )
    quantization: str | None = engine(
        None,
        "fp8: quantize a float checkpoint online in 128x128 blocks (FP8 checkpoints load as-is)",
        aliases=("-q",),
        shared=True,
    )
    seed: int | None = engine(None, "seed for requests that set none", shared=True)
    tensor_parallel_size: int | None = engine(
        None,
        "ranks the model is split over, one process each, forked by the supervising parent (on CUDA: "
        "cuda:0..N-1 of the GPUs the process sees)",
        aliases=("-tp",),
        shared=True,
    )
    enable_expert_parallel: bool | None = engine(
        None,
        "MoE: partition the experts over the tensor-parallel ranks instead of splitting each expert",
        aliases=("-ep",),
        shared=True,
    )
    # a group of ranks over several nodes (docs/parallel.md, "Across nodes")
    nnodes: int = setting(
        1,
        "nodes (pods) the tensor-parallel ranks span, each running --tensor-parallel-size / --nnodes of "
        "them: node rank 0 serves the API, the others follow its steps",
        shared=True,
    )
    node_rank: int = setting(
        0,
        "this node's place in the group, 0 .. --nnodes - 1: it runs the ranks from node_rank x (its "
        "share) on, and above 0 serves no API (vLLM's --headless)",
        shared=True,
    )
    headless: bool = setting(
        False,
        "serve no API, only follow node rank 0: what every node above rank 0 does (so it may say so)",
        shared=True,
    )
    master_addr: str | None = setting(
        None,
        "with --nnodes > 1: node rank 0's address, where the group meets (a name is looked up until "
        "it resolves)",
        shared=True,
    )
    master_port: int = setting(
        29500, "with --nnodes > 1: the group's meeting port on --master-addr", shared=True
    )
    max_prompt_logprobs_len: int | None = engine(
        None, "longest prompt whose prompt logprobs (or echo with logprobs) a request may ask for"
    )
    # LoRA adapters (server/openai/lora/serving.py, engine/lora)
    enable_lora: bool | None = engine(
        None,
        "serve LoRA adapters (on by itself with --lora-modules, --lora-modules-file or "
        "--allow-runtime-lora-updating)",
        shared=True,
    )
    max_loras: int | None = engine(
        None, "LoRA adapter slots: most distinct adapters in one batch", shared=True
    )
    max_lora_rank: int | None = engine(None, "highest LoRA rank an adapter may have", shared=True)
    lora_modules: tuple[LoraModule, ...] = setting(
        (),
        "LoRA adapters clients name in `model`: name=path, or JSON {name, path, base_model_name}; several "
        "after one flag, as vLLM takes them, or the flag repeated (the variable takes name=path entries "
        "separated by commas)",
        parse=parse_lora_module,
        metavar="NAME=PATH",
        many=True,
        shared=True,
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
        None, "directory whose files chat audio_url file: URLs may read", unset="none", shared=True
    )
    media_fetch_timeout: float = setting(
        DEFAULT_FETCH_TIMEOUT_S, "seconds one audio_url fetch may take, redirects included"
    )
    # requests
    api_key: str | None = setting(
        None,
        "require `Authorization: Bearer <key>` on every route but /health, /ready, /ping and /metrics "
        "(prefer the variable: flags show in ps)",
        shared=True,
    )
    max_request_body_bytes: int = setting(
        DEFAULT_MAX_BODY_BYTES, "larger request bodies get 413 before they are read"
    )
    trust_request_chat_template: bool = setting(
        False, "let requests send their own chat template (it runs in this process)", shared=True
    )
    tool_call_parser: str | None = setting(
        None,
        "how to recognise tool calls in the model's text (needed for tool_choice auto)",
        choices=sorted(TOOL_PARSERS),
        shared=True,
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
        False,
        "serve POST /sleep?level=1|2, POST /wake_up and GET /is_sleeping (vLLM's sleep mode)",
        shared=True,
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
    worker_load_timeout: float = setting(
        600.0,
        "seconds a worker may take from its fork to serving (loading its model) before the parent "
        "restarts it as hung (the operator: spec.startupTimeoutSeconds)",
    )
    max_failed_restarts: int = setting(
        5, "failed worker restarts in a row after which the parent's /health answers 503"
    )
    # process snapshots of the supervising parent (snapshot/, docs/snapshots.md)
    snapshot_store: str | None = setting(
        None,
        "the node's snapshot store (read-only): restore the supervising parent from a snapshot of this "
        "start instead of importing, and ask the node agent (--cache-socket-dir) for one when none fits",
        unset="off: the parent imports",
        metavar="DIR",
    )
    criu: str = setting("criu", "the CRIU binary that restores snapshots: a path, or a name on PATH")
    restore_timeout: float = setting(
        30.0, "seconds CRIU, then the restored parent's resume, may take before the parent imports instead"
    )
    # the HTTP server
    uvicorn_log_level: str = setting("info", "uvicorn's log level", shared=True)
    access_log: bool = setting(False, "log every request (uvicorn's access log)")
