"""FP8 block quantization, the gated activations and the grouped reference MoE against direct computations."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.nn import functional as F

from keepwarm_runtime.engine.moe.activation import GatedActivation, apply_gated
from keepwarm_runtime.engine.moe.reference import ExpertWeights, reference_moe
from keepwarm_runtime.weights.fp8 import E4M3, dequantize_blocks, dequantize_gate_up, quantize_blocks


def test_quantize_matches_transformers_fp8_quantize_bit_for_bit() -> None:
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    config = SimpleNamespace(
        quantization_config=SimpleNamespace(weight_block_size=[128, 128], scale_fmt=None)
    )
    torch.manual_seed(0)
    w = torch.randn(3, 256, 384) * torch.logspace(
        -3, 1, 384
    )  # per-column spread: blocks get different scales
    w[0, :128, :128] = 0  # an all-zero block keeps scale 1
    theirs = Fp8Quantize(config)._quantize_one("experts.gate_up_proj", w)
    q, s = quantize_blocks(w)
    assert q.dtype == E4M3 and s.shape == (3, 2, 3)
    assert torch.equal(q.view(torch.uint8), theirs["experts.gate_up_proj"].view(torch.uint8))
    assert torch.equal(s, theirs["experts.gate_up_proj_scale_inv"])
    assert s[0, 0, 0] == 1.0


def test_round_trip_error_is_within_e4m3_precision_and_partial_blocks_work() -> None:
    torch.manual_seed(1)
    w = torch.randn(200, 300)  # 2 x 3 blocks, the last ones partial (like DeepSeek's 576-row kv_a_proj)
    q, s = quantize_blocks(w)
    assert s.shape == (2, 3)
    back = dequantize_blocks(q, s, torch.float32)
    # e4m3: 3 mantissa bits -> relative error <= 2^-4 on normals; subnormals bounded by the block's step
    step = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300] * 2.0**-9
    assert torch.all((back - w).abs() <= w.abs() * 2.0**-4 + step)
    exact = back.clone()  # values already on the grid survive a second round trip exactly
    assert torch.equal(dequantize_blocks(*quantize_blocks(exact), torch.float32), exact)
    with pytest.raises(ValueError, match="scale grid"):
        dequantize_blocks(q, s[:, :2], torch.float32)


def test_gate_up_halves_keep_their_own_blocks() -> None:
    torch.manual_seed(2)
    gate, up = torch.randn(2, 72, 128), 50 * torch.randn(2, 72, 128)  # I = 72: halves do not align to 128
    (qg, sg), (qu, su) = quantize_blocks(gate), quantize_blocks(up)
    fused = dequantize_gate_up(torch.cat([qg, qu], 1), torch.cat([sg, su], 1), torch.float32, True)
    expected = torch.cat(
        [dequantize_blocks(qg, sg, torch.float32), dequantize_blocks(qu, su, torch.float32)], 1
    )
    assert torch.equal(fused, expected)
    one_grid = dequantize_gate_up(torch.cat([qg, qu], 1), torch.cat([sg, su], 1), torch.float32, False)
    assert not torch.equal(one_grid, expected)  # same grid height (2 rows), different meaning


def _gpt_oss_experts():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = GptOssConfig(hidden_size=32, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
    return GptOssExperts(config), config


def test_clamped_swiglu_matches_transformers_gpt_oss_and_a_direct_formula() -> None:
    experts, config = _gpt_oss_experts()
    torch.manual_seed(3)
    gate_up = 12 * torch.randn(64, 48)  # large: the limit (7) clamps many entries
    act = GatedActivation(
        "swiglu", alpha=config.swiglu_alpha, beta=1.0, limit=config.swiglu_limit, interleaved=True
    )
    ours = apply_gated(gate_up, act)
    assert torch.equal(ours, experts._apply_gate(gate_up))
    direct = torch.empty(64, 24)
    for i in range(64):
        for j in range(24):
            g, u = float(gate_up[i, 2 * j]), float(gate_up[i, 2 * j + 1])
            g, u = min(g, 7.0), max(-7.0, min(u, 7.0))
            direct[i, j] = (u + 1) * g / (1 + torch.exp(torch.tensor(-1.702 * g)))
    torch.testing.assert_close(ours, direct, rtol=1e-5, atol=1e-5)
    assert (gate_up[:, ::2] > 7).any() and (gate_up[:, 1::2].abs() > 7).any()


def test_plain_swiglu_and_geglu() -> None:
    x = torch.randn(5, 16)
    assert torch.equal(apply_gated(x, GatedActivation("swiglu")), F.silu(x[:, :8]) * x[:, 8:])
    assert torch.equal(apply_gated(x, GatedActivation("geglu")), F.gelu(x[:, :8]) * x[:, 8:])
    with pytest.raises(ValueError, match="SwiGLU parameters"):
        GatedActivation("geglu", limit=7.0)


def _dense(hidden, index, scores, weights: ExpertWeights, act: GatedActivation) -> torch.Tensor:
    """Token by token, expert by expert: the definition the grouped reference must equal."""
    out = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        for slot in range(index.shape[1]):
            e = int(index[t, slot])
            gate_up_w, down_w = weights.expert(e, torch.float32)
            h = gate_up_w @ hidden[t]
            if weights.gate_up_bias is not None:
                h = h + weights.gate_up_bias[e]
            y = down_w @ apply_gated(h, act)
            if weights.down_bias is not None:
                y = y + weights.down_bias[e]
            out[t] += scores[t, slot] * y
    return out


@pytest.mark.parametrize("fmt", ["float32", "fp8"])
@pytest.mark.parametrize("style", ["qwen", "gpt_oss"])
def test_reference_moe_equals_dense_per_token(fmt, style) -> None:
    torch.manual_seed(4)
    E, H, inter, T, k = 6, 32, 24, 23, 2
    gate_up, down = torch.randn(E, 2 * inter, H) / 4, torch.randn(E, H, inter) / 4
    kwargs = {}
    act = GatedActivation("swiglu")
    if style == "gpt_oss":
        act = GatedActivation("swiglu", alpha=1.702, beta=1.0, limit=0.5, interleaved=True)
        kwargs = {"gate_up_bias": torch.randn(E, 2 * inter), "down_bias": torch.randn(E, H)}
    if fmt == "fp8":
        (gate_up, gu_s), (down, d_s) = quantize_blocks(gate_up), quantize_blocks(down)
        kwargs |= {"gate_up_scale_inv": gu_s, "down_scale_inv": d_s}
    weights = ExpertWeights(gate_up, down, **kwargs)
    hidden = torch.randn(T, H)
    index = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    index[:5] = 3  # a crowded expert; expert 5 may get none
    index[:5, 1] = 0
    scores = torch.rand(T, k)
    got = reference_moe(hidden, index, scores, weights, act)
    torch.testing.assert_close(got, _dense(hidden, index, scores, weights, act), rtol=1e-5, atol=1e-5)
    if style == "gpt_oss" and fmt == "float32":  # transposed storage: same numbers
        t = ExpertWeights(gate_up.transpose(1, 2), down.transpose(1, 2), transposed=True, **kwargs)
        torch.testing.assert_close(reference_moe(hidden, index, scores, t, act), got, rtol=1e-6, atol=1e-6)


def test_reference_moe_refuses_out_of_range_experts_and_handles_no_tokens() -> None:
    w = ExpertWeights(torch.randn(2, 8, 4), torch.randn(2, 4, 4))
    act = GatedActivation("swiglu")
    assert reference_moe(
        torch.randn(0, 4), torch.zeros(0, 1, dtype=torch.long), torch.ones(0, 1), w, act
    ).shape == (
        0,
        4,
    )
    with pytest.raises(ValueError, match="routed expert ids"):
        reference_moe(torch.randn(1, 4), torch.tensor([[2]]), torch.ones(1, 1), w, act)
