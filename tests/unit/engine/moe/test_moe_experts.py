"""Recognising each model's expert gate, and attaching a backend per experts module."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from keepwarm_runtime.engine.moe.experts import (
    RUNNER_ATTR,
    gated_activation,
    keepwarm_experts_forward,
    prepare_experts,
)
from keepwarm_runtime.engine.moe.oracle import MoEBackendError


def _experts(model_type: str, **overrides) -> nn.Module:
    from transformers import AutoConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    classes = {"qwen3_moe": Qwen3MoeExperts, "deepseek_v3": DeepseekV3Experts, "gpt_oss": GptOssExperts}
    sizes = {"hidden_size": 32, "intermediate_size": 16, "moe_intermediate_size": 16, "num_experts": 4}
    config = AutoConfig.for_model(
        model_type, **(sizes | {"n_routed_experts": 4, "num_local_experts": 4} | overrides)
    )
    torch.manual_seed(0)
    module = classes[model_type](config)
    for p in module.parameters():
        nn.init.normal_(p, std=0.3)
    return module


class _Holder(nn.Module):
    def __init__(self, experts: nn.Module):
        super().__init__()
        self.experts = experts


@pytest.mark.parametrize(
    ("model_type", "kind", "clamped"), [("qwen3_moe", "swiglu", False), ("gpt_oss", "swiglu", True)]
)
def test_gate_is_recognised_and_runs_like_transformers(model_type, kind, clamped) -> None:
    module = _experts(model_type)
    act = gated_activation(module)
    assert act is not None and act.kind == kind and (act.limit is not None) == clamped
    choices = prepare_experts(_Holder(module), "auto", torch.device("cpu"))
    assert [(c.module, c.backend) for c in choices] == [("experts", "torch")]
    hidden = torch.randn(9, 32)
    index = torch.stack([torch.randperm(4)[:2] for _ in range(9)])
    weights = torch.rand(9, 2)
    module.config._experts_implementation = "eager"
    expected = module(hidden, index, weights)  # transformers' own eager loop
    torch.testing.assert_close(keepwarm_experts_forward(module, hidden, index, weights), expected)


def test_unknown_gate_keeps_transformers_implementation_or_is_refused_when_named() -> None:
    module = _experts("deepseek_v3", hidden_act="relu")  # no keepwarm activation reproduces relu-gating
    assert gated_activation(module) is None
    choices = prepare_experts(_Holder(module), "auto", torch.device("cpu"))
    assert choices[0].backend == "transformers" and "not one keepwarm reproduces" in choices[0].reason
    assert getattr(module, RUNNER_ATTR) is not None
    with pytest.raises(MoEBackendError, match="does not recognise this expert gate"):
        prepare_experts(_Holder(_experts("deepseek_v3", hidden_act="relu")), "torch", torch.device("cpu"))


def test_flashinfer_requested_on_cpu_is_an_error_quoting_the_reason() -> None:
    with pytest.raises(MoEBackendError, match="needs a CUDA device"):
        prepare_experts(_Holder(_experts("qwen3_moe")), "flashinfer_cutlass", torch.device("cpu"))


def test_forward_without_prepare_is_a_named_error() -> None:
    with pytest.raises(RuntimeError, match="before prepare_experts"):
        keepwarm_experts_forward(
            _experts("qwen3_moe"), torch.randn(1, 32), torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2)
        )


def _routing():
    g = torch.Generator().manual_seed(5)
    return (
        torch.randn(6, 32, generator=g),
        torch.randint(0, 4, (6, 2), generator=g),
        torch.rand(6, 2, generator=g),
    )


def test_a_kernel_is_trusted_only_after_agreeing_with_the_reference() -> None:
    import dataclasses

    from keepwarm_runtime.engine.moe.experts import _torch_runner, checked

    module = _experts("gpt_oss")
    act = gated_activation(module)
    reference = _torch_runner(module, act)
    calls = []

    def same(*args):
        calls.append(1)
        return reference(*args)

    run = checked("experts", "fake", same, reference, 0.03)
    hidden, index, weights = _routing()
    run(hidden, index, weights)
    run(hidden, index, weights)
    assert len(calls) == 2  # trusted after the first check

    clamp_ignored = _torch_runner(module, dataclasses.replace(act, limit=None))
    run = checked("experts", "fake", clamp_ignored, reference, 0.03)
    torch.testing.assert_close(run(hidden, index, weights), reference(hidden, index, weights))
    torch.testing.assert_close(run(hidden, index, weights), reference(hidden, index, weights))

    def broken(*args):
        raise RuntimeError("no kernel image for this device")

    run = checked("experts", "fake", broken, reference, 0.03)
    torch.testing.assert_close(run(hidden, index, weights), reference(hidden, index, weights))
