"""FP8 in the model: nn.Linear layers and fused experts that hold e4m3 weights plus block scales.

A quantized nn.Linear becomes `Fp8Linear` (same module, class swapped, a `weight_scale_inv` parameter
added): its torch reference forward dequantizes the blocks into the activation dtype and runs one
matmul, which is what transformers' own dequantizing FP8 path computes. Fused experts gain
`gate_up_proj_scale_inv` / `down_proj_scale_inv` beside their weights; the MoE backends read them
(engine.moe.reference). The entry point is `prepare_checkpoint_fp8`, before the weights are filled
(placeholders on meta the loader then points at checkpoint tensors, or at tensors quantized online
into an arena). `online_targets` names what online quantization converts; the arena's fill
(weights/arena.py, the daemon's and the disk path's alike) quantizes exactly those tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from keepwarm_runtime.engine.moe.experts import HALVES_APART_ATTR
from keepwarm_runtime.engine.quant import fp8_gemm
from keepwarm_runtime.log_once import log_once
from keepwarm_runtime.weights.fp8 import dequantize_blocks
from keepwarm_runtime.weights.quantization import SCALE_SUFFIX, Fp8Settings, QuantizationError
from keepwarm_runtime.weights.serving_layout import is_experts_module

log = logging.getLogger(__name__)


class Fp8Linear(nn.Linear):
    """nn.Linear with an e4m3 weight `[out, in]` and float32 `weight_scale_inv` per 128x128 block.

    On CPU (and wherever the GPU kernel is not trusted) it dequantizes the weight and runs one matmul.
    On CUDA it checks torch's block-scaled `scaled_mm` against its emulation on the first input and
    uses it from then on if they agree (engine.quant.fp8_gemm), logging the decision once."""

    block: tuple[int, int] = (128, 128)
    gpu_kernel: bool | None = None  # None: not decided yet; decided on the first CUDA input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and self.gpu_kernel is not False:
            flat = x.reshape(-1, x.shape[-1])
            if self.gpu_kernel is None:
                self.gpu_kernel, why = fp8_gemm.checked_kernel(flat, self.weight, self.weight_scale_inv)
                # one line per decision, not per module: the key drops the per-call detail in brackets
                log_once(log, logging.INFO, why.split(" (")[0], "FP8 linear: %s", why)
            if self.gpu_kernel:
                out = fp8_gemm.scaled_mm(flat, self.weight, self.weight_scale_inv, x.dtype)
                out = out if self.bias is None else out + self.bias
                return out.reshape(*x.shape[:-1], out.shape[-1])
        weight = dequantize_blocks(self.weight, self.weight_scale_inv, x.dtype, self.block)
        return F.linear(x, weight, self.bias)


def _grid(shape, block) -> tuple[int, int]:
    return -(-shape[-2] // block[0]), -(-shape[-1] // block[1])


def _placeholder(shape) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=torch.float32, device="meta"), requires_grad=False)


def _as_fp8_linear(module: nn.Linear, block: tuple[int, int]) -> None:
    module.__class__ = Fp8Linear
    module.block = block
    module.register_parameter("weight_scale_inv", _placeholder(_grid(module.weight.shape, block)))


def prepare_checkpoint_fp8(model: nn.Module, settings: Fp8Settings, has_tensor: Callable[[str], bool]) -> int:
    """Before filling: make every module whose tensors carry block scales hold e4m3 + scales.
    Returns how many modules were converted. `has_tensor` asks the attached tensors by model name.

    `settings.source == "online"` is a float checkpoint quantized into its arena at load
    (`online_targets`, `quantize_blocks`): each fused expert stack is one quantized tensor with one
    scale grid over its stored shape. A checkpoint's
    experts are quantized per expert and projection, so gate and up carry a grid each."""
    converted = 0
    online = settings.source == "online"
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and has_tensor(f"{name}.weight{SCALE_SUFFIX}"):
            _as_fp8_linear(module, settings.block)
            converted += 1
        elif is_experts_module(module) and hasattr(module, "gate_up_proj"):
            merged = has_tensor(f"{name}.gate_up_proj{SCALE_SUFFIX}")  # merged by the weight cache
            if not (merged or has_tensor(f"{name}.0.gate_proj.weight{SCALE_SUFFIX}")):
                continue
            gate_up, down = module.gate_up_proj, module.down_proj
            if online or (merged and getattr(module, "is_transposed", False)):
                # One grid over the stored shape: online quantization's, and a fused checkpoint tensor's
                # (gpt-oss stores `[E, H, 2I]` with gate/up interleaved; its blocks run over those axes).
                rows = _grid(gate_up.shape, settings.block)
            elif getattr(module, "is_transposed", False):
                raise QuantizationError(
                    f"{name}: FP8 experts stored transposed and per expert are not a layout keepwarm "
                    "knows; serve the float checkpoint, optionally with --quantization fp8"
                )
            else:
                # Checkpoint scales are per expert and projection, so gate and up carry a grid each,
                # whether the loader or the weight cache concatenated them: ceil(I / 128) rows per half.
                half = -(-(gate_up.shape[-2] // 2) // settings.block[0])
                rows = (2 * half, _grid(gate_up.shape, settings.block)[1])
                setattr(module, HALVES_APART_ATTR, True)
            module.register_parameter("gate_up_proj" + SCALE_SUFFIX, _placeholder((gate_up.shape[0], *rows)))
            module.register_parameter(
                "down_proj" + SCALE_SUFFIX, _placeholder((down.shape[0], *_grid(down.shape, settings.block)))
            )
            converted += 1
    return converted
