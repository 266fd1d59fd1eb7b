"""EngineConfig: everything the engine needs to know before it loads a model.

Each field is declared once, here: its name, type, default and (``count``) lower bound. `keepwarm serve`
builds one EngineConfig (``from_settings``, server/cli.py) from the settings its user gave, and hands
that object to the background attach (engine/prefetch.py), the engine and the speech engine; ``given``
says which fields came from the user, so an engine with defaults of its own (Whisper's) keeps them.
No torch here (``torch_dtype`` imports it when asked): the server builds this config before the
background attach starts, and that thread, not the main line, is the first to pay for importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from keepwarm_api.values import SERVING_DTYPES, CacheMode, Quantization
from keepwarm_runtime.engine.moe import oracle as moe_oracle
from keepwarm_runtime.weights import layouts

if TYPE_CHECKING:
    import torch

    from keepwarm_runtime.weights.tensor_parallel import Sharding

ATTENTION_BACKENDS = ("auto", "torch", "cpu", "flashinfer")
MOE_BACKENDS = ("auto", *moe_oracle.BACKENDS)
QUANTIZATIONS = (None, Quantization.FP8.value)  # online quantization of a bf16/fp32 checkpoint
_AT_LEAST = "keepwarm.at_least"  # field metadata: the smallest value a count may take (None passes)


def count(default: int | None) -> Any:
    """A field that counts something: at least 1 (or None where its type allows)."""
    return field(default=default, metadata={_AT_LEAST: 1})


@dataclass
class EngineConfig:
    model_dir: str
    dtype: str = "float32"  # weights and activations: float32 | bfloat16 | float16
    device: str = "cpu"  # "cpu", "cuda", "cuda:1", ...
    max_num_seqs: int = count(64)  # most sequences in one batch
    max_num_batched_tokens: int = count(4096)  # most tokens (prefill + decode) in one forward pass
    block_size: int = count(16)  # tokens per KV-cache block
    num_kv_blocks: int | None = count(None)  # None: sized from kv_cache_memory_gib (CPU) or free GPU memory
    max_model_len: int | None = None  # None: the model's max_position_embeddings, capped by the KV cache
    attention_backend: str = (
        "auto"  # auto (flashinfer on CUDA when installed; cpu on CPU when its kernel builds; else torch)
    )
    moe_backend: str = "auto"  # experts backend; auto: first eligible (engine.moe.oracle.AUTO_ORDER)
    quantization: str | None = None  # "fp8": quantize linear and expert weights online, 128x128 blocks
    expert_layout: str = layouts.MODEL  # or flashinfer_cutlass: experts as it takes them
    cache_socket_dir: str | None = None  # node weight cache socket dir; None: read the checkpoint from disk
    cache_mode: str = CacheMode.ZERO_COPY.value  # a CacheMode (see keepwarm_runtime.cache.client.attach)
    cache_fallback: bool = True  # fall back to disk when the cache cannot serve the model
    cache_trusted_uids: frozenset[int] = frozenset()  # uids besides ours and root's that may own the socket
    # a read-only folder of CPU attention kernel builds (the node agent's) loaded before building one
    # (engine/attention/native.py); None: only this process's own build cache
    kernel_cache: str | None = None
    seed: int = 0  # seeds sampling of requests that set no seed of their own
    enable_prefix_caching: bool = True  # share KV blocks between requests with a common prompt prefix
    kv_cache_memory_gib: float = 1.0  # CPU: KV-cache budget when num_kv_blocks is None
    # CPU bfloat16 with native bf16 (AVX-512 BF16, AMX): keep oneDNN's packed copy of each linear weight
    # (faster steps; as much private memory again as the linear layers) (engine/cpu_linear.py)
    cpu_packed_weights: bool = True
    # CPU bfloat16 on AMX: steps of up to 64 tokens on keepwarm's AMX kernel, the weights read in place
    # (engine/cpu_linear.py, csrc/amx_linear.cpp); results may differ from oneDNN's by one bfloat16 ulp
    cpu_amx_linear: bool = True
    # CPU bfloat16 on AVX-512 BF16 without AMX: every step on keepwarm's kernel, the weights read in
    # place, none packed (engine/cpu_linear.py, csrc/avx512_linear.cpp); results may differ by one ulp
    cpu_bf16_linear: bool = True
    # CPU float32 on AVX-512: steps of up to 128 tokens on keepwarm's kernel, the weights read in place
    # (engine/cpu_linear.py, csrc/avx512_linear.cpp); results may differ from MKL's by float32 rounding
    cpu_f32_linear: bool = True
    # CPU: fused RMSNorm, activation-and-mul and rotary kernels where a model's modules compute what they
    # do (engine/cpu_fused.py REFERENCES)
    cpu_fused_ops: bool = True
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of total memory weights + KV cache may use
    # CUDA: no decode graphs (engine/decode_graphs.py), every step launched from Python (vLLM's flag)
    enforce_eager: bool = False
    # the next step launched before this one's tokens are landed (engine/overlap.py; vLLM's flag).
    # None: on CUDA, off on CPU (where a step's pass runs where it is launched: nothing would overlap)
    async_scheduling: bool | None = None
    max_prompt_logprobs_len: int = count(32768)  # longest prompt whose prompt logprobs a request may ask for
    enable_lora: bool = False  # serve PEFT LoRA adapters per request (engine/lora)
    max_loras: int = count(4)  # adapter slots on the device: most distinct adapters in one batch
    max_lora_rank: int = count(64)  # adapters of a higher rank are refused at load
    # tensor/expert parallel (engine/parallel): one process per rank, each holding its shard
    tensor_parallel_size: int = count(1)  # ranks the model is split over (vLLM's tensor_parallel_size)
    enable_expert_parallel: bool = False  # MoE: partition the experts over the ranks, not split each one
    # set per process by whoever starts the ranks (LLM, the supervising parent), never by a user:
    tensor_parallel_rank: int = 0  # this process's rank in its group
    distributed_init_method: str | None = None  # the group's rendezvous: file://PATH or tcp://HOST:PORT
    # the fields the user set (`keepwarm serve`'s flags and KEEPWARM_* variables), in the order given;
    # the others hold the defaults above
    given: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.dtype not in SERVING_DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported; use one of {', '.join(SERVING_DTYPES)}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend {self.attention_backend!r} is unknown; "
                f"use one of {', '.join(ATTENTION_BACKENDS)}"
            )
        if self.moe_backend not in MOE_BACKENDS:
            raise ValueError(
                f"moe_backend {self.moe_backend!r} is unknown; use one of {', '.join(MOE_BACKENDS)}"
            )
        layouts.check_layout(self.expert_layout)
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization {self.quantization!r} is not supported; use fp8 or leave it unset"
            )
        for f in fields(self):
            least, value = f.metadata.get(_AT_LEAST), getattr(self, f.name)
            if least is not None and value is not None and value < least:
                raise ValueError(f"{f.name} must be at least {least}, got {value}")
        if not 0 <= self.tensor_parallel_rank < self.tensor_parallel_size:
            raise ValueError(
                f"tensor_parallel_rank {self.tensor_parallel_rank} is not in a group of "
                f"{self.tensor_parallel_size}"
            )
        if self.tensor_parallel_size > 1 and self.enable_lora:
            raise ValueError("LoRA adapters are not served with tensor_parallel_size > 1 (engine/parallel)")
        unknown = set(self.given) - {f.name for f in fields(self)}
        if unknown:
            raise ValueError(f"given names no EngineConfig field: {', '.join(sorted(unknown))}")

    @classmethod
    def from_settings(cls, model_dir: str, **settings: Any) -> EngineConfig:
        """The config of these settings, each named in ``given`` (what `keepwarm serve` builds)."""
        return cls(model_dir, **settings, given=tuple(settings))

    def given_values(self) -> dict[str, Any]:
        """The fields the user set, with their values."""
        return {name: getattr(self, name) for name in self.given}

    @property
    def sharding(self) -> Sharding:
        """The slice of the model this process holds (weights.tensor_parallel)."""
        from keepwarm_runtime.weights.tensor_parallel import Sharding

        return Sharding(self.tensor_parallel_rank, self.tensor_parallel_size, self.enable_expert_parallel)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)
