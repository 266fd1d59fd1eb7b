"""A tiny random Whisper checkpoint on disk (`keepwarm make-model --arch whisper`): transformers'
WhisperConfig, a locally trained BPE tokenizer with Whisper's special tokens, the feature extractor
and a generation config like OpenAI's."""

from __future__ import annotations

from pathlib import Path

LANGUAGES = ("en", "fr", "de")
SPECIALS = [
    "<|endoftext|>",
    "<|startoftranscript|>",
    *(f"<|{code}|>" for code in LANGUAGES),
    "<|translate|>",
    "<|transcribe|>",
    "<|startoflm|>",
    "<|startofprev|>",
    "<|nospeech|>",
    "<|notimestamps|>",
]


def make_whisper(path: Path, *, max_length: int = 40, seed: int = 0, dtype: str = "float32") -> Path:
    """Write a ~0.3M-parameter random Whisper to ``path`` in ``dtype``; greedy output runs to
    ``max_length`` tokens."""
    import torch
    from transformers import (
        GenerationConfig,
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
    )

    from keepwarm_runtime.modelgen.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(1024)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS}, replace_extra_special_tokens=False)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIALS}
    eot, sot = ids["<|endoftext|>"], ids["<|startoftranscript|>"]
    vocab = len(tokenizer)
    config = WhisperConfig(
        vocab_size=vocab,
        num_mel_bins=80,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_source_positions=1500,
        max_target_positions=448,
        pad_token_id=eot,
        bos_token_id=eot,
        eos_token_id=eot,
        decoder_start_token_id=sot,
    )
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(config).eval()
    model.generation_config = GenerationConfig(
        decoder_start_token_id=sot,
        eos_token_id=eot,
        pad_token_id=eot,
        bos_token_id=eot,
        max_length=max_length,
        suppress_tokens=[ids["<|startoflm|>"], ids["<|startofprev|>"], ids["<|nospeech|>"], 7, 11],
        begin_suppress_tokens=[12, eot],
        lang_to_id={f"<|{code}|>": ids[f"<|{code}|>"] for code in LANGUAGES},
        task_to_id={"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]},
        no_timestamps_token_id=ids["<|notimestamps|>"],
        is_multilingual=True,
    )
    model.to(getattr(torch, dtype)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    WhisperFeatureExtractor(feature_size=80, sampling_rate=16000).save_pretrained(path)
    return path
