"""The KV probe pass on meta tensors records what the pass on real weights records (head counts, key
and value widths, dtype, sliding window, sinks, calls), for every architecture the engine is tested
on; a model whose forward needs values falls back to the real pass."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaConfig

from keepwarm_runtime.engine import kv_cache
from keepwarm_runtime.engine.attention.fuser import fuse_attention
from keepwarm_runtime.engine.attention.layer import KeepwarmAttention, KVSpec
from tests.engine_architectures import ENGINE_ARCHS
from tests.unit.engine.test_fuser import meta_model


class BranchesOnAValue(nn.Module):
    """One attention layer behind a branch on a weight's value, which a meta tensor cannot answer."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.ones(1))
        self.attn = KeepwarmAttention(0, None, "BranchesOnAValue")
        self.config = LlamaConfig(num_hidden_layers=1)  # no sliding window

    def forward(self, input_ids, position_ids, use_cache, logits_to_keep) -> torch.Tensor:
        heads = 4 if float(self.gate) > 0 else 2
        x = self.gate.new_zeros(1, heads, input_ids.shape[1], 8)
        return self.attn(x, x[:, :2], x[:, :2])


def _real_model(arch: str) -> tuple[nn.Module, list[KeepwarmAttention]]:
    model = meta_model(arch).to_empty(device="cpu")
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.copy_(
                torch.randn(tensor.shape, generator=torch.Generator().manual_seed(0)).to(tensor.dtype)
            )
    return model, fuse_attention(model.get_decoder())


def _recorded(layers: list[KeepwarmAttention]) -> list[tuple]:
    return [(layer.kv_spec, layer.probe_window, layer.probe_sinks, layer.probe_calls) for layer in layers]


@pytest.mark.parametrize("arch", ENGINE_ARCHS)
def test_the_meta_probe_records_what_the_real_one_does(arch: str) -> None:
    model, layers = _real_model(arch)
    assert kv_cache._probe_on_meta(model, layers)  # no weight read on a restart
    on_meta = _recorded(layers)
    kv_cache._probe(model, layers, torch.zeros(1, 1, dtype=torch.long))
    assert on_meta == _recorded(layers)


def test_a_forward_that_needs_values_falls_back_to_the_real_pass() -> None:
    model = BranchesOnAValue()
    assert not kv_cache._probe_on_meta(model, [model.attn])
    assert model.attn.kv_spec is None  # nothing half-recorded is left behind
    assert kv_cache.probe_kv_specs(model, [model.attn], torch.device("cpu")) == [
        KVSpec(num_kv_heads=2, key_dim=8, value_dim=8, dtype=torch.float32)
    ]
