"""Beyond the named architectures: any transformers causal LM runs token-identical to transformers or
is refused up front, with an error naming what is unsupported. Silently different output is the one
unacceptable result.

The models are transformers' own classes with tiny random configs (not keepwarm make-model), so this
exercises attention discovery on modelling code nobody here wrote for it. A sweep over every causal-LM
type in transformers found the failure modes these tests pin down: BERT-style models built as encoders
(bidirectional attention) and looped models that call one attention module several times per step
(both ran and differed before), models that pick attention classes by name (a KeyError), and Mixtral's
legacy expert names (refused before).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from keepwarm_runtime import LLM, SamplingParams
from keepwarm_runtime.engine.attention.fuser import AttentionFusionError
from keepwarm_runtime.engine.loader import ModelLoadError
from tests.integration.engine.reference import transformers_greedy

NEW_TOKENS = 6
SMALL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 2048,
    "max_position_embeddings": 512,
    "initializer_range": 0.15,  # sharp attention: a wrong mask or scale changes greedy tokens
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}


@pytest.fixture(scope="module")
def tokenizer_dir(make_tiny) -> Path:
    return make_tiny("llama")  # vocab 2048: its tokenizer files serve every model here


def transformers_model(model_type: str, out: Path, tokenizer_dir: Path, **overrides):
    """A random transformers model of `model_type`, saved with a tokenizer; returns the live model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **(SMALL | overrides))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(out)
    for path in tokenizer_dir.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens")) or path.suffix == ".jinja":
            shutil.copy(path, out / path.name)
    return model


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(10, 2000, (n,), generator=g).tolist() for n in (3, 11, 19, 30)]


@pytest.mark.parametrize(
    ("model_type", "overrides"),
    [
        ("gpt2", {"n_embd": 64, "n_layer": 2, "n_head": 4}),  # absolute positions, Conv1D projections
        ("bert", {"is_decoder": True}),  # an encoder family, causal when built as a decoder
        ("starcoder2", {}),  # sliding window, biases
        ("mixtral", {"num_local_experts": 4}),  # legacy expert names, renamed then merged at load
    ],
)
def test_unnamed_architecture_matches_transformers(model_type, overrides, tmp_path, tokenizer_dir) -> None:
    model = transformers_model(model_type, tmp_path, tokenizer_dir, **overrides)
    expected = transformers_greedy(model, _prompts(), NEW_TOKENS)
    llm = LLM(tmp_path, dtype="float32", block_size=4, num_kv_blocks=128, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    got = [
        o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in _prompts()], params)
    ]
    assert got == expected


def test_window_shorter_than_the_prompt_matches_transformers(tmp_path, tokenizer_dir) -> None:
    """Moshi's attention call passes no window, yet generate() keeps only the last window-1 tokens in its
    cache: prompt tokens see the whole prompt, generated tokens only the window (differed before)."""
    overrides = {"sliding_window": 8, "audio_vocab_size": 64, "num_codebooks": 2}
    model = transformers_model("moshi", tmp_path, tokenizer_dir, **overrides)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(10, 2000, (n,), generator=g).tolist() for n in (20, 29, 40)]
    expected = transformers_greedy(model, prompts, NEW_TOKENS)
    llm = LLM(tmp_path, dtype="float32", block_size=4, num_kv_blocks=128, max_num_batched_tokens=12)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert got == expected


@pytest.mark.parametrize(
    ("model_type", "overrides", "error", "message"),
    [
        ("bert", {}, AttentionFusionError, r"BertSelfAttention at '.*' is not causal"),
        ("dory", {}, AttentionFusionError, r"more than once per forward pass \(DoryAttention layer_idx"),
        ("bloom", {"n_layer": 2, "n_head": 4}, AttentionFusionError, "no module under BloomModel"),
        ("falcon_mamba", {}, ModelLoadError, r"layer types \['linear_attention'\]"),
        ("git", {}, ModelLoadError, "git: transformers cannot build this model"),
    ],
)
def test_unsupported_architecture_is_refused_up_front(
    model_type, overrides, error, message, tmp_path, tokenizer_dir
) -> None:
    transformers_model(model_type, tmp_path, tokenizer_dir, **overrides)
    with pytest.raises(error, match=message):
        LLM(tmp_path, dtype="float32", num_kv_blocks=64)
