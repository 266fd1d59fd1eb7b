"""A tiny random Voxtral checkpoint on disk (transformers' VoxtralConfig, Llama text model), with a
locally trained tokenizer that has an audio placeholder token. Voxtral's own processor needs
mistral-common; tests build the prompt ids themselves (one placeholder per audio embedding)."""

from __future__ import annotations

from pathlib import Path

AUDIO, BEGIN_AUDIO = "[AUDIO]", "[BEGIN_AUDIO]"
MEL_BINS = 128


def make_voxtral(path: Path, seed: int = 0) -> Path:
    import torch
    from transformers import VoxtralConfig, VoxtralForConditionalGeneration, WhisperFeatureExtractor

    from keepwarm_runtime.modelgen.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(1024)
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [AUDIO, BEGIN_AUDIO]}, replace_extra_special_tokens=False
    )
    config = VoxtralConfig(
        audio_config={
            "model_type": "voxtral_encoder",
            "hidden_size": 64,
            "intermediate_size": 256,  # the projector groups 4 encoder frames into one audio embedding
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_mel_bins": MEL_BINS,
            "max_source_positions": 1500,
        },
        text_config={
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "vocab_size": len(tokenizer),
            "max_position_embeddings": 2048,
            "eos_token_id": tokenizer.eos_token_id,
            "bos_token_id": tokenizer.bos_token_id,
        },
        audio_token_id=tokenizer.convert_tokens_to_ids(AUDIO),
    )
    torch.manual_seed(seed)
    model = VoxtralForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    WhisperFeatureExtractor(feature_size=MEL_BINS).save_pretrained(path)
    return path
