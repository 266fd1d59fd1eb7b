"""The loader's last FP8 check: an e4m3 weight without its block scales is refused, never read as float."""

from __future__ import annotations

import pytest
from torch import nn

from keepwarm_runtime.engine.loader import ModelLoadError, _check_fp8_scales
from keepwarm_runtime.weights.fp8 import E4M3, quantize_blocks


def _e4m3_linear(with_scale: bool) -> nn.Linear:
    layer = nn.Linear(128, 128, bias=False)
    q, scale = quantize_blocks(layer.weight.detach())
    layer.weight = nn.Parameter(q, requires_grad=False)
    if with_scale:
        layer.weight_scale_inv = nn.Parameter(scale, requires_grad=False)
    return layer


def test_e4m3_weight_without_scales_is_refused_by_name() -> None:
    model = nn.Sequential(_e4m3_linear(True), _e4m3_linear(False))
    with pytest.raises(ModelLoadError, match=r"1 FP8 weights have no block scales .*: 1\.weight"):
        _check_fp8_scales(model)


def test_scaled_and_float_weights_pass() -> None:
    model = nn.Sequential(_e4m3_linear(True), nn.Linear(4, 4))
    _check_fp8_scales(model)
    assert model[0].weight.dtype == E4M3
