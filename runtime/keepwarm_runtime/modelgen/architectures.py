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


ARCHITECTURES: dict[str, ArchBuilder] = {
    "llama": llama,
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
