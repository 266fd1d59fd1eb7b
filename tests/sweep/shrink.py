"""A tiny random config for any transformers model type: the documented shrink the sweep uses.

Starting from the type's default config (its own `to_dict()`), every size the config has is set small:
width 64, 4 heads of 16 with 2 KV heads (GQA), FFN 128, vocab 2048, 512 positions, and the MoE/MLA
sizes (4 experts, top-2, LoRA ranks 32; MLA keeps one K/V head per head and head_dim as its rotary
width); special token ids are the shared tokenizer's (0/1/2). A window the model uses is set to 8,
shorter than the long prompts. A config with `is_decoder` (the BERT family) is built as a decoder, the
way its causal-LM class is meant to be used. Layers: one per distinct entry of `layer_types` (at least
2), in first-seen order, so a sliding/full hybrid keeps both kinds; other per-layer lists are cut to
the same length. Every config nested in the dict (text, vision, audio) is shrunk the same way.
transformers' validators then run on the result; a shrink they reject is retried on the text config
alone, then with the sizes alone as constructor arguments (the config derives its own layer_types),
then reported with the errors.
"""

from __future__ import annotations

from typing import Any

WINDOW = 8  # shorter than the sweep's long prompts

# Canonical names and the older aliases some configs store instead (gpt2's n_embd, bart's d_model ...).
SIZES: dict[str, Any] = {
    "hidden_size": 64,
    "n_embd": 64,
    "d_model": 64,
    "n_embed": 64,
    "emb_dim": 64,  # XLM
    "intermediate_size": 128,
    "n_inner": 128,
    "ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "ffn_hidden_size": 128,  # LongCat-Flash
    "expert_ffn_hidden_size": 32,
    "encoder_ffn_dim": 128,
    "num_attention_heads": 4,
    "n_head": 4,
    "n_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rotary_dim": 8,  # GPT-J / CodeGen: rotary width within head_dim
    "vocab_size": 2048,
    "vocab_size_per_layer_input": 2048,  # Gemma 3n/4 per-layer embeddings
    "hidden_size_per_layer_input": 16,
    "unpadded_vocab_size": 2048,
    "max_position_embeddings": 512,
    "n_positions": 512,
    "initializer_range": 0.15,  # sharp attention: a wrong mask or scale changes greedy tokens
    "is_decoder": True,  # BERT-style configs: their causal-LM classes are meant to run as decoders
    # MoE
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_k": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,  # one dense layer, one MoE layer
    "decoder_sparse_step": 1,
    # MLA
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "qk_head_dim": 24,  # nope + rope, where the config stores it (LongCat-Flash)
    # Mamba layers of hybrid models (refused, but only a valid config reaches the refusal)
    "mamba_n_heads": 8,
    "mamba_d_head": 16,  # 8 x 16 = mamba_expand x hidden_size
    "mamba_expand": 2,
    "mamba_d_state": 16,
    "mamba_n_groups": 1,
    "mamba_d_ssm": 128,
}
LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers")
WINDOWS = ("sliding_window",)
# The shared tokenizer's special tokens (make-model's): the config's must agree, or generate() and
# keepwarm would disagree on which token is EOS (keepwarm also honours the tokenizer's).
TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1}
# Defaults that must not be replaced by a size: None means "derived" or "off" in these configs.
KEEP_NONE = {"q_lora_rank", "sliding_window", "moe_intermediate_size"}


def shrink_dict(config: dict[str, Any]) -> dict[str, Any]:
    """The shrunk copy of one config dict (nested configs included)."""
    out = dict(config)
    for key, value in SIZES.items():
        if key in out and not (out[key] is None and key in KEEP_NONE):
            out[key] = value
    if "qk_rope_head_dim" in out and config.get("head_dim") == config["qk_rope_head_dim"]:
        out["head_dim"] = out["qk_rope_head_dim"]  # MLA configs keep head_dim as the rotary width
    if "kv_lora_rank" in out and out.get("num_key_value_heads") is not None:
        out["num_key_value_heads"] = out["num_attention_heads"]  # MLA expands K/V to every head
    for key, token in TOKENS.items():
        if key in out:
            out[key] = token
    for key in WINDOWS:
        if isinstance(out.get(key), int):
            out[key] = WINDOW
    old_layers = next((out[k] for k in LAYER_COUNTS if isinstance(out.get(k), int)), None)
    new_layers = 2
    layer_types = out.get("layer_types")
    kinds: list = []
    if isinstance(layer_types, list) and layer_types:
        kinds = list(dict.fromkeys(layer_types))
        new_layers = max(2, len(kinds))
        out["layer_types"] = (kinds * new_layers)[:new_layers]
    if (out.get("num_kv_shared_layers") or 0) > 0 and kinds:  # KV sharing (Gemma 3n): every kind both
        new_layers = 2 * len(kinds)  # produces (first half) and reuses (second half) a KV cache
        out["layer_types"] = kinds * 2
        out["num_kv_shared_layers"] = len(kinds)
    if "n_recurrent_layers" in out:  # looped models (Dory): input + recurrent + output layers
        new_layers = max(new_layers, 3)
        out["layer_types"] = (kinds * new_layers)[:new_layers] if isinstance(layer_types, list) else None
        out |= {"n_input_layers": 1, "n_recurrent_layers": new_layers - 2, "n_output_layers": 1}
    if isinstance(out.get("per_layer_config"), dict):  # per-layer overrides, keyed by layer index
        out["per_layer_config"] = {
            k: shrink_dict(v) for k, v in out["per_layer_config"].items() if int(k) < new_layers
        }
    if old_layers is not None:
        for key in LAYER_COUNTS:
            if isinstance(out.get(key), int):
                out[key] = new_layers
        for key, value in list(out.items()):
            if key != "layer_types" and isinstance(value, list) and len(value) == old_layers:
                out[key] = value[:new_layers]
    for key, value in list(out.items()):
        if isinstance(value, dict) and "model_type" in value:
            out[key] = shrink_dict(value)
    return out


def tiny_config(model_type: str):
    """The shrunk config for `model_type`, validated by transformers; raises what its validators raise."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type).to_dict()
    errors = []
    for shrink in (shrink_dict, _shrink_text_only, _sizes_only):
        shrunk = shrink(default)
        kwargs = {k: v for k, v in shrunk.items() if k not in ("model_type", "transformers_version")}
        try:
            return AutoConfig.for_model(model_type, **kwargs)
        except Exception as exc:  # each config validates differently; try the next shrink
            errors.append(f"{type(exc).__name__}: {exc}")
    raise ValueError(f"no valid tiny config for {model_type}: {' / '.join(errors)}")


def _shrink_text_only(config: dict[str, Any]) -> dict[str, Any]:
    text = config.get("text_config")
    if isinstance(text, dict):
        return config | {"text_config": shrink_dict(text)}
    top = {k: v for k, v in config.items() if not (isinstance(v, dict) and "model_type" in v)}
    return config | shrink_dict(top)


def _sizes_only(config: dict[str, Any]) -> dict[str, Any]:
    """Only the sizes, as constructor arguments: the config derives the rest (its own layer_types)."""
    shrunk = shrink_dict(config)
    keys = [
        *SIZES,
        *TOKENS,
        *WINDOWS,
        *LAYER_COUNTS,
        "n_input_layers",
        "n_recurrent_layers",
        "n_output_layers",
    ]
    return {k: shrunk[k] for k in keys if k in shrunk and k != "layer_types"} | {
        "model_type": config["model_type"]
    }
