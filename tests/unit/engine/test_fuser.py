"""Attention discovery: the registry call, its softmax scale and the layer index, per module class."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from keepwarm_runtime.engine.attention.dispatch import register_keepwarm_attention
from keepwarm_runtime.engine.attention.fuser import AttentionFusionError, analyze_class, fuse_attention
from keepwarm_runtime.engine.attention.layer import KeepwarmAttention
from keepwarm_runtime.modelgen.architectures import ARCHITECTURES
from tests.engine_architectures import ENGINE_ARCHS


def _yarn_mscale(factor: float, mscale_all_dim: float) -> float:
    return 0.1 * mscale_all_dim * math.log(factor) + 1.0


def expected_scale(arch: str, config) -> float:
    """The scale each architecture's paper/config implies, computed without looking at the module."""
    if arch in ("gemma2", "gemma3"):
        return config.query_pre_attn_scalar**-0.5
    if arch == "opt":
        return 1.0  # q is pre-scaled inside OPTAttention
    if arch.startswith("deepseek_v3"):
        base = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
        rope = config.rope_parameters
        if rope.get("rope_type") == "yarn":
            base *= _yarn_mscale(rope["factor"], rope["mscale_all_dim"]) ** 2
        return base
    return config.head_dim**-0.5


def meta_model(arch: str) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    register_keepwarm_attention()
    config = AutoConfig.for_model(**ARCHITECTURES[arch](64, 3, 512))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, attn_implementation="keepwarm")


@pytest.mark.parametrize("arch", ENGINE_ARCHS)
def test_attention_dispatch_is_matched(arch: str) -> None:
    model = meta_model(arch)
    layers = fuse_attention(model.get_decoder())
    config = model.config
    assert [layer.layer_idx for layer in layers] == list(range(config.num_hidden_layers))
    attached = {id(m) for _, m in model.named_modules() if isinstance(m, KeepwarmAttention)}
    assert attached == {id(layer) for layer in layers}
    want = expected_scale(arch, config)
    for layer in layers:
        assert layer.scale == pytest.approx(want, rel=1e-9), f"{arch}: {layer.owner}"
    if arch.startswith("deepseek_v3") and "yarn" in arch:
        assert layers[0].scale != pytest.approx((config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5)
    for name, module in model.named_modules():
        if isinstance(getattr(module, "keepwarm_attn", None), KeepwarmAttention) and arch != "opt":
            assert module.keepwarm_attn.scale == module.scaling, name  # the model's own value


def _eager(*args, **kwargs):
    raise AssertionError("not called")


class FakeLongcatAttention(nn.Module):
    """Two of these per decoder layer, indices 2L and 2L+1, as in LongCat-Flash."""

    def __init__(self, layer_idx: int, scaling: float = 0.125):
        super().__init__()
        self.layer_idx = layer_idx
        self.scaling = scaling
        self.proj = nn.Linear(8, 8)

    def forward(self, hidden, implementation="keepwarm", **kwargs):
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, _eager)
        return attention_interface(self, hidden, hidden, hidden, None, scaling=self.scaling, **kwargs)


class FakeLongcatLayer(nn.Module):
    def __init__(self, layer: int):
        super().__init__()
        self.self_attn = nn.ModuleList([FakeLongcatAttention(2 * layer), FakeLongcatAttention(2 * layer + 1)])
        self.mlp = nn.Linear(8, 8)


class FakeLongcat(nn.Module):
    def __init__(self, num_layers: int = 3, indices: list[int] | None = None):
        super().__init__()
        self.layers = nn.ModuleList([FakeLongcatLayer(i) for i in range(num_layers)])
        if indices is not None:
            for attn, idx in zip(self.attentions(), indices, strict=True):
                attn.layer_idx = idx

    def attentions(self) -> list[FakeLongcatAttention]:
        return [m for m in self.modules() if isinstance(m, FakeLongcatAttention)]


def test_two_attentions_per_layer_keep_their_own_indices() -> None:
    model = FakeLongcat(num_layers=3)
    layers = fuse_attention(model)
    assert [layer.layer_idx for layer in layers] == list(range(6))
    assert all(layer.scale == 0.125 for layer in layers)
    names = {name for name, m in model.named_modules() if isinstance(m, KeepwarmAttention)}
    assert "layers.1.self_attn.1.keepwarm_attn" in names and len(names) == 6


def test_duplicate_layer_index_is_an_error() -> None:
    with pytest.raises(AttentionFusionError, match="layer_idx 1 is used by both"):
        fuse_attention(FakeLongcat(num_layers=2, indices=[0, 1, 1, 3]))


def test_missing_layer_index_is_an_error() -> None:
    model = FakeLongcat(num_layers=1)
    del model.attentions()[0].layer_idx
    with pytest.raises(AttentionFusionError, match="no integer layer_idx"):
        fuse_attention(model)


class ComputedScaleAttention(FakeLongcatAttention):
    def forward(self, hidden, **kwargs):
        attention_interface = ALL_ATTENTION_FUNCTIONS["keepwarm"]
        return attention_interface(self, hidden, hidden, hidden, None, scaling=self.proj.in_features**-0.5)


class TwoCallsAttention(FakeLongcatAttention):
    def forward(self, hidden, **kwargs):
        fn = ALL_ATTENTION_FUNCTIONS.get_interface("keepwarm", _eager)
        fn(self, hidden, hidden, hidden, None, scaling=1.0)
        return fn(self, hidden, hidden, hidden, None, scaling=1.0)


class LiteralScaleAttention(FakeLongcatAttention):
    def forward(self, hidden, **kwargs):
        return ALL_ATTENTION_FUNCTIONS.get_interface("keepwarm", _eager)(
            self, hidden, hidden, hidden, None, scaling=1
        )


class HelperDispatchAttention(FakeLongcatAttention):
    def forward(self, hidden, **kwargs):
        return _dispatch(ALL_ATTENTION_FUNCTIONS, self, hidden)


class CommentOnlyModule(nn.Module):
    def forward(self, hidden):
        # Not an ALL_ATTENTION_FUNCTIONS call site: a comment must not make this an attention module
        return hidden


def _dispatch(registry, module, hidden):
    return registry.get_interface("keepwarm", _eager)(module, hidden, hidden, hidden, None, scaling=1.0)


def test_registry_used_but_unresolvable_is_refused_by_name() -> None:
    with pytest.raises(AttentionFusionError, match=r"HelperDispatchAttention.forward uses ALL_ATTENTION"):
        analyze_class(HelperDispatchAttention)
    assert analyze_class(CommentOnlyModule) is None


def test_transformers_class_without_source_is_refused_by_name() -> None:
    namespace: dict = {}
    exec("def forward(self, hidden):\n    return hidden\n", namespace)  # no source file to read
    cls = type("GeneratedAttention", (nn.Module,), {"forward": namespace["forward"]})
    cls.__module__ = "transformers.models.generated.modeling_generated"
    with pytest.raises(AttentionFusionError, match=r"GeneratedAttention\.forward has no readable source"):
        analyze_class(cls)
    cls.__module__ = "somewhere_else"
    analyze_class.cache_clear()
    assert analyze_class(cls) is None


def test_unresolvable_scale_names_the_class() -> None:
    with pytest.raises(AttentionFusionError, match="ComputedScaleAttention: cannot resolve"):
        analyze_class(ComputedScaleAttention)


def test_two_registry_calls_are_refused() -> None:
    with pytest.raises(AttentionFusionError, match=r"TwoCallsAttention.*2 times"):
        analyze_class(TwoCallsAttention)


def test_literal_scale_and_non_attention_modules() -> None:
    assert analyze_class(LiteralScaleAttention).scaling_value == 1.0
    assert analyze_class(nn.Linear) is None
    assert analyze_class(FakeLongcatLayer) is None


def test_non_causal_attention_is_refused_naming_the_class() -> None:
    model = FakeLongcat(num_layers=1)
    model.attentions()[1].is_causal = False  # an encoder or cross-attention module
    with pytest.raises(
        AttentionFusionError, match=r"FakeLongcatAttention at 'layers.0.self_attn.1' is not causal"
    ):
        fuse_attention(model)


def test_model_without_registry_attention_is_refused() -> None:
    with pytest.raises(AttentionFusionError, match="no module under Sequential"):
        fuse_attention(nn.Sequential(nn.Linear(2, 2)))


def test_only_the_text_model_of_a_multimodal_model_is_switched() -> None:
    from transformers import AutoModelForCausalLM, Gemma3Config

    from keepwarm_runtime.engine.loader import attention_implementations

    register_keepwarm_attention()
    text = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 512,
    }
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": 28,
        "patch_size": 14,
    }
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=attention_implementations(config)
        )
    assert model.config.get_text_config()._attn_implementation == "keepwarm"
    assert model.config.vision_config._attn_implementation == "sdpa"
    layers = fuse_attention(model.get_decoder())
    assert [layer.layer_idx for layer in layers] == [0, 1]
    assert not any(isinstance(m, KeepwarmAttention) for m in model.model.vision_tower.modules())
