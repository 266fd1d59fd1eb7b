"""The MoE eligibility oracle over the full product of formats, activations, clamps, backends and GPUs."""

from __future__ import annotations

import itertools

import pytest

from keepwarm_runtime.engine.moe.oracle import (
    ACTIVATIONS,
    AUTO_ORDER,
    BACKENDS,
    ELIGIBILITY,
    WEIGHT_FORMATS,
    MoEBackendError,
    MoELayerFacts,
    choose_backend,
)

CAPABILITIES = [None, (7, 0), (8, 0), (8, 9), (9, 0), (10, 0), (10, 3), (12, 0)]
PARAM_SETS = [(False, False, False), (True, True, True), (False, False, True), (True, False, False)]


def facts(fmt, act, params, cap, experts=8, hidden=256, inter=512) -> MoELayerFacts:
    alpha, beta, limit = params
    return MoELayerFacts(fmt, act, alpha, beta, limit, experts, hidden, inter, cap)


PRODUCT = list(itertools.product(WEIGHT_FORMATS, ACTIVATIONS, PARAM_SETS, BACKENDS, CAPABILITIES))


@pytest.mark.parametrize(("fmt", "act", "params", "backend", "cap"), PRODUCT)
def test_every_combination_answers_with_a_reason(fmt, act, params, backend, cap) -> None:
    f = facts(fmt, act, params, cap)
    ok, reason = ELIGIBILITY[backend](f)
    assert isinstance(ok, bool) and len(reason) > 10
    clamp = any(params)
    # The upstream contract: SwiGLU parameters reach a kernel only with block-scaled FP8 (or bf16)
    # weights and a SwiGLU-family activation.
    if ok and clamp:
        assert act == "swiglu"
        if backend != "torch":  # the reference dequantizes first, so any loaded format honours a clamp
            assert fmt in ("fp16", "bf16", "fp8_block128")
    if clamp and act != "swiglu" and fmt != "mxfp8":  # mxfp8 is refused first, by its own name
        assert not ok and "SwiGLU parameters" in reason
    if fmt == "fp8_per_tensor" and clamp and act == "swiglu" and backend != "torch":
        assert not ok and "clamp would be ignored" in reason
    if fmt == "mxfp8":
        assert not ok and "mxfp8" in reason
    if (
        backend != "torch"
        and cap is None
        and fmt in ("fp32", "fp16", "bf16", "fp8_block128")
        and not (clamp and act != "swiglu")
    ):
        assert not ok and "CUDA" in reason
    if backend != "torch" and cap in ((7, 0), (12, 0)):
        assert not ok  # Volta and consumer Blackwell: no family these kernels are built for
        if fmt in ("fp16", "bf16", "fp8_block128") and not (clamp and act != "swiglu"):
            assert "capability" in reason
    if backend == "flashinfer_trtllm" and ok:
        assert cap is not None and cap[0] == 10 and fmt == "fp8_block128" and act == "swiglu"
    if backend == "flashinfer_cutlass" and ok and fmt == "fp8_block128":
        assert cap == (9, 0)
    if backend != "torch" and fmt == "fp32":
        assert not ok  # no FlashInfer MoE kernel takes float32 weights
    if backend == "torch":
        assert ok == (fmt != "mxfp8" and not (clamp and act != "swiglu"))


@pytest.mark.parametrize(
    ("fmt", "act", "params", "cap"),
    list(itertools.product(WEIGHT_FORMATS, ACTIVATIONS, PARAM_SETS, CAPABILITIES)),
)
def test_auto_takes_the_first_eligible_backend_in_order(fmt, act, params, cap) -> None:
    f = facts(fmt, act, params, cap)
    eligible = [b for b in AUTO_ORDER if ELIGIBILITY[b](f)[0]]
    if not eligible:
        with pytest.raises(MoEBackendError, match="no MoE backend can run this layer"):
            choose_backend("auto", f)
        return
    assert choose_backend("auto", f)[0] == eligible[0]
    for backend in BACKENDS:
        if backend in eligible:
            assert choose_backend(backend, f)[0] == backend
        else:
            with pytest.raises(MoEBackendError) as err:
                choose_backend(backend, f)
            assert ELIGIBILITY[backend](f)[1] in str(err.value)  # the error quotes the oracle's reason


@pytest.mark.parametrize(
    ("fmt", "act", "params", "cap", "expected"),
    [
        (
            "fp8_block128",
            "swiglu",
            (False, False, False),
            (9, 0),
            "flashinfer_cutlass",
        ),  # DeepSeek-V3 on H100
        ("fp8_block128", "swiglu", (False, False, False), (10, 0), "flashinfer_trtllm"),  # ... on B200
        ("fp8_block128", "swiglu", (True, True, True), (10, 0), "flashinfer_trtllm"),  # clamped, block-scaled
        ("bf16", "swiglu", (True, True, True), (9, 0), "flashinfer_cutlass"),  # gpt-oss bf16 on H100
        ("bf16", "swiglu", (True, True, True), (10, 0), "flashinfer_cutlass"),
        ("fp8_per_tensor", "swiglu", (True, True, True), (10, 0), "torch"),  # no kernel honours the clamp
        ("fp8_block128", "geglu", (False, False, False), (10, 0), "torch"),
        ("bf16", "swiglu", (False, False, False), None, "torch"),
        ("bf16", "geglu", (False, False, False), (12, 0), "torch"),
        ("fp32", "swiglu", (False, False, False), (9, 0), "torch"),  # a float32-served model on H100
    ],
)
def test_auto_choices_for_known_models(fmt, act, params, cap, expected) -> None:
    assert choose_backend("auto", facts(fmt, act, params, cap))[0] == expected


def test_explicit_ineligible_backend_quotes_the_reason() -> None:
    f = facts("fp8_per_tensor", "swiglu", (True, True, True), (10, 0))
    with pytest.raises(MoEBackendError, match="clamp would be ignored"):
        choose_backend("flashinfer_trtllm", f)


def test_shape_and_expert_limits_are_refused_by_name() -> None:
    many = facts("fp8_block128", "swiglu", (False,) * 3, (10, 0), experts=384)
    assert "exceed" in ELIGIBILITY["flashinfer_trtllm"](many)[1]
    odd = facts("fp8_block128", "swiglu", (False,) * 3, (9, 0), hidden=200)
    assert not ELIGIBILITY["flashinfer_cutlass"](odd)[0]
    assert "divisible by 128" in ELIGIBILITY["flashinfer_cutlass"](odd)[1]


def test_missing_package_makes_a_backend_unavailable_not_wrong() -> None:
    f = facts("fp8_block128", "swiglu", (False,) * 3, (10, 0))
    missing = {"flashinfer_trtllm": "flashinfer-python is not installed", "flashinfer_cutlass": "same"}
    assert choose_backend("auto", f, missing)[0] == "torch"
    with pytest.raises(MoEBackendError, match="not installed"):
        choose_backend("flashinfer_trtllm", f, missing)


def test_unknown_names_are_refused() -> None:
    with pytest.raises(ValueError, match="weight format"):
        facts("int4", "swiglu", (False,) * 3, None)
    with pytest.raises(ValueError, match="activation"):
        facts("bf16", "relu2", (False,) * 3, None)
    with pytest.raises(MoEBackendError, match="unknown"):
        choose_backend("triton", facts("bf16", "swiglu", (False,) * 3, None))
