"""engine/kv_cache.py's probe on the meta model: the same KV specs as the probe with the weights, for
every architecture keepwarm generates (windows, softcap, sinks, MLA, MoE); a model the meta pass
cannot run is probed with its weights."""

from __future__ import annotations

import pytest
import torch

from keepwarm_runtime.engine.attention.fuser import fuse_attention
from keepwarm_runtime.engine.kv_cache import probe_kv_specs, probe_on_meta
from keepwarm_runtime.engine.llm import LLM
from keepwarm_runtime.modelgen.architectures import ARCHITECTURES


def _probe_state(engine) -> list[tuple]:
    return [(at.kv_spec, at.probe_window, at.probe_sinks, at.cache_window) for at in engine.layers]


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_the_meta_probe_finds_what_the_probe_with_weights_finds(model_type, make_tiny) -> None:
    engine = LLM(str(make_tiny(model_type)), num_kv_blocks=8).engine
    assert engine.kv_probed_on_meta, f"{model_type}: the meta pass failed; see the log"
    on_meta = _probe_state(engine)
    specs = probe_kv_specs(engine.model, engine.layers, engine.device)  # again, with the weights
    assert specs == engine.kv_specs and _probe_state(engine) == on_meta


def test_a_model_the_meta_pass_cannot_run_is_probed_with_its_weights(make_tiny, caplog) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = make_tiny("llama")
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="keepwarm")
    layers = fuse_attention(model.get_decoder())
    # .item() has no meta kernel: the pass fails at the first layer, as an op without one would.
    model.get_decoder().layers[0].register_forward_pre_hook(lambda _m, args: args[0].sum().item() and None)
    with caplog.at_level("INFO", logger="keepwarm_runtime.engine.kv_cache"):
        assert probe_on_meta(model, layers) is False
    assert "the meta pass failed" in caplog.text
    assert all(layer.kv_spec is None and layer.probe_calls == 0 for layer in layers)
    model.to_empty(device="cpu")  # any values: the probe reads shapes
    specs = probe_kv_specs(model, layers, torch.device("cpu"))
    assert len(specs) == config.num_hidden_layers and all(layer.probe_calls == 1 for layer in layers)
