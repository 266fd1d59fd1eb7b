"""EngineConfig: everything the engine needs to know before it loads a model.

No torch here (``torch_dtype`` imports it when asked): `keepwarm serve` can build its EngineConfig
before it starts the background attach (engine/prefetch.py), and that thread, not the main line, is
the first to pay for importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from keepwarm_api.values import SERVING_DTYPES, CacheMode, Quantization
from keepwarm_runtime.engine.moe import layouts
from keepwarm_runtime.engine.moe import oracle as moe_oracle

if TYPE_CHECKING:
    import torch

ATTENTION_BACKENDS = ("auto", "torch", "cpu", "flashinfer")
MOE_BACKENDS = ("auto", *moe_oracle.BACKENDS)
QUANTIZATIONS = (None, Quantization.FP8.value)  # online quantization of a bf16/fp32 checkpoint


@dataclass
class EngineConfig:
    model_dir: str
    dtype: str = "float32"  # weights and activations: float32 | bfloat16 | float16
    device: str = "cpu"  # "cpu", "cuda", "cuda:1", ...
    max_num_seqs: int = 64  # most sequences in one batch
    max_num_batched_tokens: int = 4096  # most tokens (prefill + decode) in one forward pass
    block_size: int = 16  # tokens per KV-cache block
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory_gib (CPU) or free GPU memory
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
    seed: int = 0  # seeds sampling of requests that set no seed of their own
    enable_prefix_caching: bool = True  # share KV blocks between requests with a common prompt prefix
    kv_cache_memory_gib: float = 1.0  # CPU: KV-cache budget when num_kv_blocks is None
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of total memory weights + KV cache may use
    max_prompt_logprobs_len: int = 32768  # longest prompt whose prompt logprobs a request may ask for
    enable_lora: bool = False  # serve PEFT LoRA adapters per request (engine/lora)
    max_loras: int = 4  # adapter slots on the device: most distinct adapters in one batch
    max_lora_rank: int = 64  # adapters of a higher rank are refused at load

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
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "max_prompt_logprobs_len",
            "max_loras",
            "max_lora_rank",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}")

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)
