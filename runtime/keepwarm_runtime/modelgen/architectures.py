"""Config presets for the architectures `keepwarm make-model` can generate.

Each builder maps (hidden size, layer count, vocab size) to the keyword arguments of a real
transformers config. Sizing picks the hidden size from the requested parameter count and solves for
the layer count from the exact per-layer count of a meta-device model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

ConfigKwargs = dict[str, Any]
ArchBuilder = Callable[[int, int, int], ConfigKwargs]


def _round_to(value: float, multiple: int) -> int:
    return max(multiple, round(value / multiple) * multiple)


def _heads(hidden: int) -> tuple[int, int]:
    """(attention heads, key/value heads): head_dim 64 from 256 up, grouped-query attention."""
    heads = max(4, hidden // 64)
    return heads, max(1, heads // 2)


def llama(hidden: int, layers: int, vocab: int) -> ConfigKwargs:
    heads, kv_heads = _heads(hidden)
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": _round_to(hidden * 8 / 3, 64),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }


# --- Architectures the engine is tested on (tiny random models; small windows so tests exercise them).


def _dense(model_type: str, hidden: int, layers: int, vocab: int, **extra: Any) -> ConfigKwargs:
    heads, kv_heads = _heads(hidden)
    base = llama(hidden, layers, vocab) | {"model_type": model_type, "head_dim": hidden // heads}
    base["num_key_value_heads"] = kv_heads
    return base | extra


def gemma(hidden: int, layers: int, vocab: int) -> ConfigKwargs:
    return _dense("gemma", hidden, layers, vocab, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6)


def gemma2(hidden: int, layers: int, vocab: int) -> ConfigKwargs:
    heads, _ = _heads(hidden)
    return _dense(
        "gemma2",
        hidden,
        layers,
        vocab,
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=2 * (hidden // heads),  # scale differs from head_dim**-0.5 on purpose
        sliding_window=16,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        layer_types=[("sliding_attention" if i % 2 == 0 else "full_attention") for i in range(layers)],
    )


def gemma3(hidden: int, layers: int, vocab: int) -> ConfigKwargs:
    heads, _ = _heads(hidden)
    return _dense(
        "gemma3_text",
        hidden,
        layers,
        vocab,
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=hidden // heads // 2,
        sliding_window=16,
        layer_types=[("sliding_attention" if i % 2 == 0 else "full_attention") for i in range(layers)],
    )


def mistral(hidden: int, layers: int, vocab: int) -> ConfigKwargs:
    return _dense("mistral", hidden, layers, vocab, sliding_window=16)


def qwen2(hidden: int, layers: int, vocab: int) -> ConfigKwargs:
    return _dense("qwen2", hidden, layers, vocab)


def qwen3(hidden: int, layers: int, vocab: int) -> ConfigKwargs:
    return _dense("qwen3", hidden, layers, vocab)


def qwen3_moe(hidden: int, layers: int, vocab: int) -> ConfigKwargs:
    return _dense(
        "qwen3_moe",
        hidden,
        layers,
        vocab,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=_round_to(hidden, 16),
        decoder_sparse_step=1,
        norm_topk_prob=True,
    )


def deepseek_v3(hidden: int, layers: int, vocab: int) -> ConfigKwargs:
    """Multi-head latent attention (q/kv LoRA, split rope/nope dims, v_head_dim != qk_head_dim) + MoE."""
    heads, _ = _heads(hidden)
    return {
        "model_type": "deepseek_v3",
        "hidden_size": hidden,
        "intermediate_size": _round_to(hidden * 2, 16),
        "moe_intermediate_size": _round_to(hidden // 2, 16),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "n_shared_experts": 1,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "kv_lora_rank": _round_to(hidden // 2, 16),
        "q_lora_rank": _round_to(hidden // 2, 16),
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    }


def deepseek_v3_yarn(hidden: int, layers: int, vocab: int) -> ConfigKwargs:
    """DeepSeek-V3 with yarn rope scaling: the softmax scale carries the yarn mscale squared."""
    return deepseek_v3(hidden, layers, vocab) | {
        "max_position_embeddings": 16384,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    }


def gpt_oss(hidden: int, layers: int, vocab: int) -> ConfigKwargs:
    """Attention sinks, alternating sliding windows, biased experts with gpt-oss' clamped SwiGLU. The clamp
    limit is lowered from 7 so that a tiny random model's activations actually reach it."""
    heads, kv_heads = _heads(hidden)
    return {
        "model_type": "gpt_oss",
        "hidden_size": hidden,
        "intermediate_size": _round_to(hidden, 16),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 16,
        "layer_types": [("sliding_attention" if i % 2 == 0 else "full_attention") for i in range(layers)],
        "swiglu_limit": 0.5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 150000.0},
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    }


def opt(hidden: int, layers: int, vocab: int) -> ConfigKwargs:
    heads, _ = _heads(hidden)
    return {
        "model_type": "opt",
        "hidden_size": hidden,
        "word_embed_proj_dim": hidden,
        "ffn_dim": hidden * 4,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "vocab_size": vocab,
        "max_position_embeddings": 2048,
        "do_layer_norm_before": True,
        "tie_word_embeddings": True,
    }


ARCHITECTURES: dict[str, ArchBuilder] = {
    "llama": llama,
    "gemma": gemma,
    "gemma2": gemma2,
    "gemma3": gemma3,
    "mistral": mistral,
    "qwen2": qwen2,
    "qwen3": qwen3,
    "qwen3_moe": qwen3_moe,
    "deepseek_v3": deepseek_v3,
    "deepseek_v3_yarn": deepseek_v3_yarn,
    "gpt_oss": gpt_oss,
    "opt": opt,
}

# Hidden size by parameter budget: (upper bound in parameters, hidden size).
HIDDEN_BY_PARAMS: list[tuple[float, int]] = [
    (5e6, 64),
    (30e6, 256),
    (200e6, 768),
    (700e6, 1024),
    (1.6e9, 2048),
    (float("inf"), 3072),
]


def hidden_for(params: int) -> int:
    return next(hidden for bound, hidden in HIDDEN_BY_PARAMS if params < bound)
