"""Write a random-weight Hugging Face checkpoint: config, safetensors shards, tokenizer, generation config."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PretrainedConfig

from keepwarm_api.values import SERVING_DTYPES
from keepwarm_runtime.modelgen.architectures import ARCHITECTURES, hidden_for
from keepwarm_runtime.modelgen.tokenizer import END_OF_TURN, build_tokenizer

_SUFFIXES = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9}


def parse_param_count(text: str) -> int:
    """'100M' -> 100_000_000; '1.5B' -> 1_500_000_000; '250000' -> 250000."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMbBgG]?)\s*", text)
    if not match:
        raise ValueError(f"cannot parse parameter count {text!r}; use e.g. 100M or 1.5B")
    return int(float(match.group(1)) * _SUFFIXES[match.group(2).upper()])


def _count_params(config: PretrainedConfig) -> int:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    # Tied weights are one tensor: count unique storages.
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def build_config(arch: str, params: int, vocab: int, **overrides) -> PretrainedConfig:
    """A config of ``arch`` whose model has about ``params`` parameters (at least two layers)."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; known: {', '.join(sorted(ARCHITECTURES))}")
    builder = ARCHITECTURES[arch]
    hidden = hidden_for(params)

    def config_for(layers: int) -> PretrainedConfig:
        kwargs = builder(hidden, layers, vocab) | overrides
        return AutoConfig.for_model(**kwargs)

    one, two = _count_params(config_for(1)), _count_params(config_for(2))
    per_layer, base = two - one, 2 * one - two
    layers = max(2, min(96, round((params - base) / max(per_layer, 1))))
    return config_for(layers)


def make_model(
    out: str | Path,
    arch: str = "llama",
    params: int | str = "1M",
    dtype: str = "bfloat16",
    vocab_size: int = 8192,
    seed: int = 0,
    num_shards: int = 2,
    **config_overrides,
) -> Path:
    """Generate a checkpoint in ``out`` and return its path.

    The weights are random (seeded, so the same arguments give the same bytes), stored in
    ``dtype`` across ``num_shards`` safetensors files with an index.
    """
    if dtype not in SERVING_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(SERVING_DTYPES)}")
    if isinstance(params, str):
        params = parse_param_count(params)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer(vocab_size)
    config = build_config(arch, params, len(tokenizer), **config_overrides)
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(END_OF_TURN)],
        pad_token_id=tokenizer.pad_token_id,
    )
    total_bytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    shard_bytes = max(total_bytes // max(num_shards, 1) + 1, 1 << 16)
    model.save_pretrained(out, max_shard_size=shard_bytes)
    tokenizer.save_pretrained(out)
    _ensure_index(out)
    return out


def _ensure_index(out: Path) -> None:
    """A single-shard save writes no index; write one so every checkpoint has the same layout."""
    index = out / "model.safetensors.index.json"
    single = out / "model.safetensors"
    if index.exists() or not single.exists():
        return
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        names = list(f.keys())
    weight_map = {name: single.name for name in names}
    body = {"metadata": {"total_size": single.stat().st_size}, "weight_map": weight_map}
    index.write_text(json.dumps(body, indent=2))
