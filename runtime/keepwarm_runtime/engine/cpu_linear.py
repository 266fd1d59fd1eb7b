"""float32 linear layers on CPU for steps of few tokens: the product taken weight-major.

``F.linear(x, W)`` with ``x`` [M, in] and ``W`` [out, in] reaches MKL's sgemm with the few rows of
``x`` as the left operand; for M from 2 to about 128 (a short prompt's prefill, a decode step of a
handful of sequences) that call was 1.2-2.5x slower on a 2-core AVX2 VM than the same product
taken weight-major, ``(W @ x.T).T``, which streams ``W`` once as a tall-skinny GEMM (5632x2048, M=4:
8.0 ms vs 3.2 ms; at M=1 both run as a GEMV). bfloat16 was slower that way, so only float32 layers
change. The sums are the same up to fp32 rounding order (about 1e-6 relative), as between any two
batch sizes of ``F.linear`` itself. Layers keep their class's behaviour otherwise: LoRA's forward
hooks, ``isinstance(m, nn.Linear)`` and state dicts see an ``nn.Linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Rows (tokens in the step) for which the weight-major product won in the measurements above.
MIN_ROWS, MAX_ROWS = 2, 128


class WeightMajorLinear(nn.Linear):
    """An ``nn.Linear`` whose float32 steps of MIN_ROWS..MAX_ROWS tokens run weight-major."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if not MIN_ROWS <= rows <= MAX_ROWS or x.dtype != torch.float32 or self.weight.dtype != torch.float32:
            return F.linear(x, self.weight, self.bias)
        out = torch.mm(self.weight, x.reshape(rows, x.shape[-1]).t()).t().contiguous()
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features)


# The layer classes that compute exactly nn.Linear's product (LoRA adapts these, and no subclass else).
PLAIN_LINEARS = (nn.Linear, WeightMajorLinear)


def use_weight_major_linear(model: nn.Module) -> int:
    """Turn the model's plain float32 ``nn.Linear`` layers into WeightMajorLinear (subclasses such as
    FP8 layers stay as they are); returns how many changed."""
    changed = 0
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.dtype == torch.float32:
            module.__class__ = WeightMajorLinear
            changed += 1
    return changed
