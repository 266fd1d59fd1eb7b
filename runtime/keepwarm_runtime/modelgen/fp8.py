"""Rewrite a float checkpoint as an FP8 one, in the layout released FP8 checkpoints use.

Every nn.Linear weight (but the output head and any module named in `not_converted`) and every expert
weight becomes e4m3 with a float32 `weight_scale_inv` per 128x128 block, and `config.json` gains
`quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128]}`: what DeepSeek-V3 and Qwen3-*-FP8 ship, and what transformers reads.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from keepwarm_runtime.weights.fp8 import BLOCK, quantize_blocks
from keepwarm_runtime.weights.quantization import DEFAULT_NOT_CONVERTED, SCALE_SUFFIX, Fp8Settings

_PER_EXPERT = re.compile(r"^(?P<experts>.*\.experts)\.\d+\.(gate|up|down)_proj\.weight$")


def quantizable_names(config_dir: Path, not_converted: tuple[str, ...]) -> tuple[set[str], set[str]]:
    """(nn.Linear module names to quantize, fused experts module names) of the model in `config_dir`:
    what the engine's online quantization converts (`fp8_modules.online_targets`), so an FP8
    checkpoint written here and a float one quantized at load hold the same tensors."""
    from keepwarm_runtime.weights.quantization import online_targets
    from keepwarm_runtime.weights.serving_layout import meta_model

    model = meta_model(config_dir)
    if model is None:
        raise ValueError(f"{config_dir}: transformers cannot build this model to find its linear layers")
    settings = Fp8Settings("checkpoint", BLOCK, (*DEFAULT_NOT_CONVERTED, *not_converted))
    linears, experts = set(), set()
    for name in online_targets(model, settings):
        owner, _, leaf = name.rpartition(".")
        (linears if leaf == "weight" else experts).add(owner)
    return linears, experts


def _quantize_name(name: str, linears: set[str], experts: set[str]) -> bool:
    if name.endswith(".weight") and name[: -len(".weight")] in linears:
        return True
    match = _PER_EXPERT.match(name)
    if match and match.group("experts") in experts:
        return True
    owner, _, leaf = name.rpartition(".")
    return owner in experts and leaf in ("gate_up_proj", "down_proj")


def quantize_checkpoint(model_dir: str | Path, not_converted: tuple[str, ...] = ()) -> Path:
    """Quantize the float checkpoint in `model_dir` to FP8 in place; returns `model_dir`."""
    model_dir = Path(model_dir)
    linears, experts = quantizable_names(model_dir, not_converted)
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    weight_map: dict[str, str] = index["weight_map"]
    total = 0
    for shard in sorted(set(weight_map.values())):
        tensors = load_file(model_dir / shard)
        out: dict[str, torch.Tensor] = {}
        for name, tensor in tensors.items():
            if _quantize_name(name, linears, experts):
                q, scale = quantize_blocks(tensor, BLOCK)
                out[name], out[name + SCALE_SUFFIX] = q, scale
                weight_map[name + SCALE_SUFFIX] = shard
            else:
                out[name] = tensor
        save_file(out, model_dir / shard, metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in out.values())
    index["metadata"] = {"total_size": total}
    index_path.write_text(json.dumps(index, indent=2))
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK),
        "modules_to_not_convert": [*DEFAULT_NOT_CONVERTED, *not_converted],
    }
    config_path.write_text(json.dumps(config, indent=2))
    return model_dir
