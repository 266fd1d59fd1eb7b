"""A tiny random Qwen2-Audio checkpoint on disk (`keepwarm make-model --arch qwen2_audio`):
transformers' own config classes, a locally trained tokenizer with the audio placeholder tokens, and
the processor that expands them."""

from __future__ import annotations

from pathlib import Path

AUDIO, AUDIO_BOS, AUDIO_EOS = "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"


def make_qwen2_audio(path: Path, seed: int = 0, dtype: str = "float32") -> Path:
    """Write the tiny random Qwen2-Audio (1-layer encoder, 2-layer Qwen2 decoder) to ``path`` in ``dtype``."""
    import torch
    from transformers import (
        Qwen2AudioConfig,
        Qwen2AudioForConditionalGeneration,
        Qwen2AudioProcessor,
        WhisperFeatureExtractor,
    )

    from keepwarm_runtime.modelgen.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(1024)
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [AUDIO, AUDIO_BOS, AUDIO_EOS]}, replace_extra_special_tokens=False
    )
    tokenizer.audio_token, tokenizer.audio_bos_token, tokenizer.audio_eos_token = AUDIO, AUDIO_BOS, AUDIO_EOS
    audio_id = tokenizer.convert_tokens_to_ids(AUDIO)
    config = Qwen2AudioConfig(
        audio_config={
            "model_type": "qwen2_audio_encoder",
            "d_model": 64,
            "encoder_layers": 1,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 128,
            "num_mel_bins": 80,
            "max_source_positions": 1500,
        },
        text_config={
            "model_type": "qwen2",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": len(tokenizer),
            "max_position_embeddings": 2048,
            "eos_token_id": tokenizer.eos_token_id,
            "bos_token_id": tokenizer.bos_token_id,
        },
        audio_token_index=audio_id,
    )
    torch.manual_seed(seed)
    model = Qwen2AudioForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.to(getattr(torch, dtype)).save_pretrained(path)
    processor = Qwen2AudioProcessor(
        feature_extractor=WhisperFeatureExtractor(feature_size=80), tokenizer=tokenizer, chat_template=None
    )
    processor.save_pretrained(path)
    return path
