"""Which quantization a model is served in: read from `quantization_config`, or asked for online.

keepwarm loads one quantized format: Hugging Face / DeepSeek `fp8` (e4m3 weights, float32
`weight_scale_inv` per 128x128 block, dynamic activations). Every other `quant_method` (awq, gptq,
bitsandbytes, mxfp4, compressed-tensors, static activation scales, other block sizes) is refused by
name, never loaded as if it were float. `--quantization fp8` quantizes a float checkpoint the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from keepwarm_runtime.weights.files import read_config

SCALE_SUFFIX = (
    "_scale_inv"  # `x.weight` -> `x.weight_scale_inv`; a fused `experts.gate_up_proj` -> `..._scale_inv`
)
BLOCK = (128, 128)  # (rows, columns) per scale: `weight_block_size` of the checkpoints keepwarm loads
ONLINE_QUANTIZER = "quantizer-v1"  # bump when quantize_blocks or online_targets change their output
DEFAULT_NOT_CONVERTED = ("lm_head",)  # output head stays in the serving dtype, as in released checkpoints


class QuantizationError(ValueError):
    """The checkpoint's quantization (or the one asked for) is not one keepwarm serves; says why."""


@dataclass(frozen=True)
class Fp8Settings:
    source: str  # "checkpoint" (weights arrive as e4m3 + scales) | "online" (quantized at load)
    block: tuple[int, int] = BLOCK
    not_converted: tuple[str, ...] = DEFAULT_NOT_CONVERTED  # module names (or name suffixes) left unquantized

    def converts(self, module_name: str) -> bool:
        return not any(module_name == n or module_name.endswith("." + n) for n in self.not_converted)

    def key_text(self) -> str:
        """What the weight cache key's `quantization` field says for online quantization: method,
        block, the modules left float and the quantizer's version (a change to any is a cache miss)."""
        skip = ",".join(self.not_converted)
        return f"online:fp8:block={self.block[0]}x{self.block[1]}:skip={skip}:{ONLINE_QUANTIZER}"


def _get(config, key: str, default=None):
    return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)


def fp8_settings(quantization_config, online: str | None) -> Fp8Settings | None:
    """None for a float model served as-is; Fp8Settings for an FP8 checkpoint or `online == "fp8"`."""
    if not quantization_config:
        if online in (None, "fp8"):
            return Fp8Settings("online") if online else None
        raise QuantizationError(f"online quantization {online!r} is not supported; use fp8")
    method = _get(quantization_config, "quant_method")
    if method != "fp8":
        raise QuantizationError(
            f"quant_method {method!r} is not supported by the keepwarm engine; it serves fp8 checkpoints "
            "(e4m3 weights with 128x128 block scales) or quantizes float checkpoints with --quantization fp8"
        )
    if online is not None:
        raise QuantizationError("the checkpoint is already fp8-quantized; drop --quantization")
    block = _get(quantization_config, "weight_block_size")
    if block is None or tuple(block) != BLOCK:
        raise QuantizationError(
            f"fp8 weight_block_size {block!r} is not supported; keepwarm serves [128, 128] block scales "
            "(per-tensor FP8 checkpoints are refused)"
        )
    scheme = _get(quantization_config, "activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise QuantizationError(f"fp8 activation_scheme {scheme!r} is not supported; keepwarm serves dynamic")
    fmt = _get(quantization_config, "fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantizationError(f"fp8 fmt {fmt!r} is not supported; keepwarm serves e4m3")
    scale_fmt = _get(quantization_config, "scale_fmt")
    if scale_fmt not in (None, "float32"):
        raise QuantizationError(
            f"fp8 scale_fmt {scale_fmt!r} is not supported; keepwarm reads float32 scales"
        )
    skipped = tuple(_get(quantization_config, "modules_to_not_convert", None) or DEFAULT_NOT_CONVERTED)
    return Fp8Settings("checkpoint", BLOCK, skipped)


def online_settings(model_dir: str | Path, quantization: str | None) -> Fp8Settings | None:
    """The online FP8 settings of ``model_dir`` asked with ``quantization`` (its config.json's
    ``quantization_config`` read as the engine reads it: ``fp8_settings``): None when nothing is
    quantized at load. The one answer for the daemon's arena and the engine's attach (its key's
    ``quantization`` field); an FP8 checkpoint asked to be quantized again, or any method but fp8, is
    refused by name (QuantizationError)."""
    if quantization in (None, "none"):
        return None
    settings = fp8_settings(read_config(model_dir).get("quantization_config"), quantization)
    return settings if settings is not None and settings.source == "online" else None


def online_targets(model, settings: Fp8Settings) -> list[str]:
    """Names of the parameters online quantization converts: the weight of every nn.Linear (but the
    excluded, e.g. lm_head, and those already FP8: engine.quant.fp8_modules' Fp8Linear registers
    their block scales) and every fused expert stack. Defined once here for the arena's fill
    (weights/arena.py), which quantizes them for the daemon and the disk path alike."""
    from torch import nn

    from keepwarm_runtime.weights.serving_layout import is_experts_module

    names = []
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        fp8 = f"weight{SCALE_SUFFIX}" in module._parameters
        if isinstance(module, nn.Linear) and not fp8 and settings.converts(name):
            names.append(prefix + "weight")
        elif is_experts_module(module) and hasattr(module, "gate_up_proj"):
            names += [prefix + "gate_up_proj", prefix + "down_proj"]
    return names
