"""The flashinfer_cutlass expert layout as a pure conversion: equal to the CUTLASS runner's own repack,
read back exactly by the torch reference, handed to the kernel with no copy, and named in the key."""

from __future__ import annotations

import pytest
import torch

from keepwarm_runtime.engine.config import EngineConfig
from keepwarm_runtime.engine.moe import flashinfer_backend
from keepwarm_runtime.engine.moe.activation import GatedActivation
from keepwarm_runtime.engine.moe.oracle import ELIGIBILITY, MoELayerFacts
from keepwarm_runtime.engine.moe.reference import ExpertWeights, reference_moe
from keepwarm_runtime.weights import kernel_layout
from keepwarm_runtime.weights.fp8 import quantize_blocks
from keepwarm_runtime.weights.kernel_layout import ExpertLayoutError, conversion_id, up_first
from keepwarm_runtime.weights.layouts import CONVERSION_ID

E, H, T, K = 4, 256, 24, 2
# I % 128 != 0: a checkpoint's per-half scale grids differ from one grid. One grid (online
# quantization) in whole blocks only: the only FP8 the CUTLASS kernel takes (the oracle says so).
INTER = {None: 192, "halves_apart": 192, "one_grid": 128}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _layer(fp8: str | None, biased: bool = False):
    g = torch.Generator().manual_seed(0)
    inter = INTER[fp8]
    gate_up = torch.randn(E, 2 * inter, H, generator=g) / H**0.5
    down = torch.randn(E, H, inter, generator=g) / inter**0.5
    bias = torch.randn(E, 2 * inter, generator=g) / 10 if biased else None
    if fp8 is None:
        weights = ExpertWeights(gate_up, down, gate_up_bias=bias)
    elif fp8 == "one_grid":  # online quantization: one grid over the fused stack
        (gu, gs), (d, ds) = quantize_blocks(gate_up), quantize_blocks(down)
        weights = ExpertWeights(gu, d, gate_up_bias=bias, gate_up_scale_inv=gs, down_scale_inv=ds)
    else:  # a checkpoint's: gate and up quantized apart, their grids concatenated
        (g_q, g_s), (u_q, u_s) = quantize_blocks(gate_up[:, :inter]), quantize_blocks(gate_up[:, inter:])
        d, ds = quantize_blocks(down)
        weights = ExpertWeights(
            torch.cat([g_q, u_q], 1),
            d,
            gate_up_bias=bias,
            gate_up_scale_inv=torch.cat([g_s, u_s], 1),
            down_scale_inv=ds,
            gate_up_halves_apart=True,
        )
    hidden = torch.randn(T, H, generator=g)
    index = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return weights, hidden, index, torch.rand(T, K, generator=g)


def _converted(weights: ExpertWeights) -> ExpertWeights:
    """What the daemon's arena (or the engine's disk path) holds in the flashinfer_cutlass layout."""
    swap = {"gate_up": weights.gate_up, "gate_up_bias": weights.gate_up_bias}
    if weights.gate_up_scale_inv is not None:
        swap["gate_up_scale_inv"] = weights.gate_up_scale_inv
    fields = {**vars(weights), **{k: up_first(v) for k, v in swap.items() if v is not None}, "up_first": True}
    return ExpertWeights(**fields)


def test_up_first_puts_the_up_half_first_and_is_its_own_inverse() -> None:
    t = torch.arange(2 * 6 * 2, dtype=torch.float32).view(2, 6, 2)
    swapped = up_first(t)
    assert torch.equal(swapped[:, :3], t[:, 3:]) and torch.equal(swapped[:, 3:], t[:, :3])
    assert torch.equal(up_first(swapped), t)
    in_place = t.clone()
    kernel_layout.swap_halves_(in_place)
    assert torch.equal(in_place, swapped)
    with pytest.raises(ExpertLayoutError, match="even dimension 1"):
        up_first(torch.zeros(2, 5, 4))


@pytest.mark.parametrize("fp8", [None, "one_grid", "halves_apart"])
def test_conversion_equals_the_cutlass_runners_repack_bit_for_bit(fp8) -> None:
    """The conversion the cache applies at load is exactly the copy each client used to make."""
    weights, *_ = _layer(fp8, biased=True)
    act = GatedActivation("swiglu")
    fc1, fc2 = flashinfer_backend.cutlass_layout(weights, act)  # the per-client repack (a copy)
    converted = _converted(weights)
    assert torch.equal(_bits(converted.gate_up), _bits(fc1)) and torch.equal(_bits(weights.down), _bits(fc2))
    assert torch.equal(flashinfer_backend.cutlass_bias(weights, act), converted.gate_up_bias)
    if fp8:
        assert torch.equal(flashinfer_backend.cutlass_fp8_scales(weights)[0], converted.gate_up_scale_inv)
    assert flashinfer_backend.kernel_copies(weights) == 2 + bool(fp8)


@pytest.mark.parametrize("fp8", [None, "one_grid", "halves_apart"])
def test_the_cutlass_runner_takes_converted_experts_without_a_copy(fp8) -> None:
    weights = _converted(_layer(fp8, biased=True)[0])
    act = GatedActivation("swiglu")
    fc1, fc2 = flashinfer_backend.cutlass_layout(weights, act)
    assert fc1.data_ptr() == weights.gate_up.data_ptr() and fc2.data_ptr() == weights.down.data_ptr()
    assert flashinfer_backend.cutlass_bias(weights, act).data_ptr() == weights.gate_up_bias.data_ptr()
    if fp8:
        scales = flashinfer_backend.cutlass_fp8_scales(weights)
        assert scales[0].data_ptr() == weights.gate_up_scale_inv.data_ptr()
    assert flashinfer_backend.kernel_copies(weights) == 0


@pytest.mark.parametrize("fp8", [None, "one_grid", "halves_apart"])
def test_the_reference_reads_converted_experts_exactly(fp8) -> None:
    """Converted from a model-layout layer (for one grid: quantized after the swap, as the daemon does),
    the reference computes the same numbers."""
    weights, hidden, index, scores = _layer(fp8, biased=True)
    act = GatedActivation("swiglu", alpha=1.702, beta=1.0, limit=0.75)
    expected = reference_moe(hidden, index, scores, weights, act)
    assert torch.equal(reference_moe(hidden, index, scores, _converted(weights), act), expected)


def test_online_quantization_after_the_swap_equals_the_swap_after_it_in_whole_blocks() -> None:
    """The daemon quantizes the swapped float stack; with I % 128 == 0 (all the FP8 kernel takes),
    that is the swap of the quantized one, scales included."""
    g = torch.Generator().manual_seed(2)
    gate_up = torch.randn(E, 2 * 128, H, generator=g)
    q_after, s_after = quantize_blocks(up_first(gate_up))
    q, s = quantize_blocks(gate_up)
    assert torch.equal(_bits(q_after), _bits(up_first(q))) and torch.equal(s_after, up_first(s))


def test_layouts_are_named_in_the_key_and_unknown_ones_refused() -> None:
    assert conversion_id("model") == CONVERSION_ID
    assert conversion_id("flashinfer_cutlass") == f"{CONVERSION_ID}+flashinfer-cutlass-up-first-v1"
    with pytest.raises(ExpertLayoutError, match="expert layout 'shuffled' is unknown"):
        conversion_id("shuffled")
    with pytest.raises(ExpertLayoutError, match="expert layout 'shuffled' is unknown"):
        EngineConfig("m", expert_layout="shuffled")
    with pytest.raises(ValueError, match="expert layout 'shuffled' is unknown"):
        MoELayerFacts("bf16", "swiglu", False, False, False, 8, 256, 256, (9, 0), layout="shuffled")


def _meta(arch: str):
    from transformers import AutoModelForCausalLM

    from keepwarm_runtime.modelgen.checkpoint import build_config

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(build_config(arch, 400_000, 512))


def test_targets_are_concatenated_untransposed_experts_only() -> None:
    qwen = _meta("qwen3_moe")
    targets = kernel_layout.layout_targets(qwen, "flashinfer_cutlass")
    assert targets and all(t.endswith("mlp.experts.gate_up_proj") for t in targets)
    assert kernel_layout.layout_targets(qwen, "model") == []
    # gpt-oss: transposed, interleaved (the CUTLASS runner repacks those, a counted copy)
    assert kernel_layout.layout_targets(_meta("gpt_oss"), "flashinfer_cutlass") == []
    assert kernel_layout.layout_targets(_meta("llama"), "flashinfer_cutlass") == []


@pytest.mark.parametrize("layout", ["model", "flashinfer_cutlass"])
def test_oracle_per_layout(layout) -> None:
    """torch reads both layouts; CUTLASS takes both (its own without a copy); TRT-LLM gets none of its own."""
    for fmt, cap in (("bf16", (9, 0)), ("fp8_block128", (9, 0)), ("fp8_block128", (10, 0))):
        facts = MoELayerFacts(fmt, "swiglu", True, True, True, 8, 256, 256, cap, layout=layout)
        assert ELIGIBILITY["torch"](facts)[0]
        assert ELIGIBILITY["flashinfer_cutlass"](facts)[0] == (cap == (9, 0))
        ok, reason = ELIGIBILITY["flashinfer_trtllm"](facts)
        assert ok == (cap == (10, 0) and layout == "model"), reason
        if cap == (10, 0) and layout != "model":
            assert "flashinfer_cutlass layout" in reason


def test_cutlass_refuses_fp8_experts_with_interleaved_gate_up() -> None:
    """gpt-oss FP8: a 128x128 block mixes gate and up rows, so no [up; gate] block-scaled fc1 exists;
    bf16 interleaved experts are repacked (a copy) and stay eligible."""
    fp8 = MoELayerFacts("fp8_block128", "swiglu", True, True, True, 8, 256, 256, (9, 0), interleaved=True)
    ok, reason = ELIGIBILITY["flashinfer_cutlass"](fp8)
    assert not ok and "interleaved gate/up" in reason
    assert ELIGIBILITY["torch"](fp8)[0]
    bf16 = MoELayerFacts("bf16", "swiglu", True, True, True, 8, 256, 256, (9, 0), interleaved=True)
    assert ELIGIBILITY["flashinfer_cutlass"](bf16)[0]
