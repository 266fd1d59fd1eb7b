"""A tiny random Voxtral checkpoint on disk (transformers' VoxtralConfig, Llama text model), with one
of two tokenizers: a locally trained one with an audio placeholder token (`make_voxtral`; tests build
the prompt ids themselves, one placeholder per audio embedding), or a tekken.json that mistral-common
reads, as real checkpoints ship (`make_voxtral_tekken`; Voxtral's own processor builds the prompt:
what `keepwarm make-model --arch voxtral` writes, since the server's Voxtral chat path needs it)."""

from __future__ import annotations

from pathlib import Path

AUDIO, BEGIN_AUDIO = "[AUDIO]", "[BEGIN_AUDIO]"
MEL_BINS = 128


def save_voxtral(
    path: Path, seed: int, vocab_size: int, bos: int, eos: int, pad: int, audio: int, dtype: str = "float32"
) -> None:
    """Write the tiny random Voxtral (1-layer encoder, 2-layer Llama decoder) in ``dtype`` and its
    feature extractor to ``path``; the caller writes the tokenizer whose ids these are."""
    import torch
    from transformers import VoxtralConfig, VoxtralForConditionalGeneration, WhisperFeatureExtractor

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
            "vocab_size": vocab_size,
            "max_position_embeddings": 2048,
            "eos_token_id": eos,
            "bos_token_id": bos,
        },
        audio_token_id=audio,
    )
    torch.manual_seed(seed)
    model = VoxtralForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = pad
    model.to(getattr(torch, dtype)).save_pretrained(path)
    WhisperFeatureExtractor(feature_size=MEL_BINS).save_pretrained(path)


def make_voxtral(path: Path, seed: int = 0) -> Path:
    from keepwarm_runtime.modelgen.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(1024)
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [AUDIO, BEGIN_AUDIO]}, replace_extra_special_tokens=False
    )
    ids = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    save_voxtral(path, seed, len(tokenizer), *ids, tokenizer.convert_tokens_to_ids(AUDIO))
    tokenizer.save_pretrained(path)
    return path


# A tiny tekken tokenizer (mistral-common's own format, as real Voxtral checkpoints ship): byte-level
# BPE with no merges, and the special tokens at the ranks VoxtralProcessor assumes ([AUDIO] is 24).
TEKKEN_SPECIALS = [
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]",
    "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]",
    "[ARGS]", "[CALL_ID]", "[THINK]", "[/THINK]", "[AUDIO]", "[BEGIN_AUDIO]", "[TRANSCRIBE]",
]  # fmt: skip
TEKKEN_NUM_SPECIAL = 32
TEKKEN_PATTERN = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def write_tekken(path: Path) -> int:
    """tekken.json in ``path``; returns the vocabulary size (special tokens first, then 256 bytes)."""
    import base64
    import json

    vocab = [
        {
            "rank": b,
            "token_bytes": base64.b64encode(bytes([b])).decode(),
            "token_str": chr(b) if b < 128 else None,
        }
        for b in range(256)
    ]
    specials = [{"rank": i, "token_str": s, "is_control": True} for i, s in enumerate(TEKKEN_SPECIALS)]
    size = TEKKEN_NUM_SPECIAL + len(vocab)
    tekken = {
        "config": {
            "pattern": TEKKEN_PATTERN,
            "num_vocab_tokens": len(vocab),
            "default_vocab_size": size,
            "default_num_special_tokens": TEKKEN_NUM_SPECIAL,
            "version": "v7",
        },
        "vocab": vocab,
        "special_tokens": specials,
        "audio": {
            "sampling_rate": 16000,
            "frame_rate": 12.5,
            "chunk_length_s": 30.0,
            "audio_encoding_config": {"num_mel_bins": MEL_BINS, "hop_length": 160, "window_size": 400},
        },
    }
    (path / "tekken.json").write_text(json.dumps(tekken))
    return size


def make_voxtral_tekken(path: Path, seed: int = 0, dtype: str = "float32") -> Path:
    """A tiny random Voxtral whose tokenizer is tekken.json (loaded by mistral-common, as the real ones)."""

    path.mkdir(parents=True, exist_ok=True)
    vocab_size = write_tekken(path)
    bos, eos, pad = (TEKKEN_SPECIALS.index(t) for t in ("<s>", "</s>", "<pad>"))
    save_voxtral(path, seed, vocab_size, bos, eos, pad, TEKKEN_SPECIALS.index(AUDIO), dtype)
    return path
