"""Audio-language models in the paged engine: embeddings that replace a prompt's placeholder tokens.

A request carries its audio as ``AudioFeatures``: what the model's own feature extractor made of it
(CPU work the server does in its worker threads), never embeddings. The prompt arrives with its
placeholders already expanded (as the model's processor does), as many as ``AudioSpec.count`` says
the features give. The engine runs the audio encoder (Qwen2-Audio and Voxtral: ``audio_tower`` +
``multi_modal_projector``) in its own thread, at the start of the step after the request arrives
(``encode``), so nothing outside the engine ever touches its model. From then on the request is text
to the scheduler: the runner embeds the step's tokens, overwrites the placeholder rows that fall in
the scheduled range (so chunked prefill works) and runs the decoder with keepwarm attention. The
audio's digest salts the prefix-cache hash chain, so the same text with other audio never shares KV.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from keepwarm_runtime.model_kind import AUDIO_LANGUAGE_MODELS

NEEDS_MASK = "qwen2_audio needs the feature extractor's attention mask"


@dataclass(frozen=True)
class AudioClip:
    """One feature-extractor output: ``input_features`` [rows, mels, frames] (rows: audios, or a
    Voxtral audio's 30 s chunks) and, for Qwen2-Audio, its ``attention_mask`` [rows, frames]."""

    input_features: torch.Tensor
    attention_mask: torch.Tensor | None = None


@dataclass(frozen=True)
class AudioFeatures:
    """A request's audio as it crosses from the server to the engine: the clips in prompt order, each
    encoded on its own (the shapes the model's forward() sees), and their digest."""

    clips: tuple[AudioClip, ...]
    digest: int  # of the features; salts the prefix-cache keys


@dataclass(frozen=True)
class AudioSpec:
    """What a server needs to build a request with audio for this model (EngineCapabilities.audio)."""

    model_type: str  # qwen2_audio | voxtral: picks the chat's audio marker
    placeholder_id: int  # the audio token the prompt holds once per embedding
    frames_per_embedding: int  # Voxtral: encoder frames the projector joins into one embedding

    def count(self, clip: AudioClip) -> int:
        """How many embeddings the encoder makes of ``clip``: the placeholders its prompt needs."""
        if self.model_type == "qwen2_audio":
            if clip.attention_mask is None:
                raise ValueError(NEEDS_MASK)
            lengths = clip.attention_mask.sum(-1)  # valid frames; the encoder's two strided steps:
            return int(((((lengths - 1) // 2 + 1) - 2) // 2 + 1).sum())
        rows, frames = clip.input_features.shape[0], clip.input_features.shape[-1]
        # Voxtral: the second convolution halves each row's frames, the projector joins groups of them.
        return rows * ((frames - 1) // 2 + 1) // self.frames_per_embedding


@dataclass(frozen=True)
class MultimodalInput:
    """Engine-internal: a request's encoded audio, placed by the runner at each step."""

    embeds: torch.Tensor  # [n, hidden] in prompt order, one per placeholder token
    positions: torch.Tensor  # [n] long: prompt positions of the placeholder tokens, ascending
    digest: int  # of the media; salts the prefix-cache keys


def model_class(hf_config: Any) -> type | None:
    """The transformers class for an audio-language checkpoint, or None (AutoModelForCausalLM's job)."""
    name = AUDIO_LANGUAGE_MODELS.get(getattr(hf_config, "model_type", None))
    if name is None:
        return None
    import transformers

    return getattr(transformers, name)


def audio_spec(hf_config: Any) -> AudioSpec | None:
    """The AudioSpec of an audio-language checkpoint's config, or None for a model without audio input."""
    kind = getattr(hf_config, "model_type", None)
    if kind not in AUDIO_LANGUAGE_MODELS:
        return None
    audio = hf_config.audio_config
    per = audio.intermediate_size // audio.hidden_size if kind == "voxtral" else 1
    return AudioSpec(kind, hf_config.audio_token_id, per)


def audio_features(clips: list[AudioClip]) -> AudioFeatures:
    """The request's AudioFeatures: ``clips`` in prompt order, digested (CPU work, off the engine)."""
    tensors = [t for c in clips for t in (c.input_features, c.attention_mask) if t is not None]
    return AudioFeatures(tuple(clips), media_digest(*tensors))


def media_digest(*tensors: torch.Tensor) -> int:
    """A stable 63-bit digest of the media's features."""
    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return int.from_bytes(h.digest(), "little") >> 1


@torch.inference_mode()
def audio_embeddings(
    model: nn.Module, input_features: torch.Tensor, feature_attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """[n, hidden]: the embeddings of ``input_features`` [audios, mels, frames] (from the model's
    feature extractor), in order, as the model's own forward() computes them. Qwen2-Audio also needs
    the extractor's ``feature_attention_mask``."""
    kind = model.config.model_type
    if kind == "qwen2_audio":
        if feature_attention_mask is None:
            raise ValueError(NEEDS_MASK)
        return _qwen2_audio_embeds(model, input_features, feature_attention_mask)
    if kind == "voxtral":
        tower = model.model.audio_tower
        features = input_features.to(tower.device, tower.dtype)
        return model.model.get_audio_features(features, return_dict=True).pooler_output
    raise ValueError(f"{kind} models take no audio input")


def placeholder_mismatch(prompt_ids: list[int], placeholder_id: int, count: int) -> str | None:
    """Why ``prompt_ids`` cannot take ``count`` audio embeddings, or None when its placeholders match."""
    found = prompt_ids.count(placeholder_id)
    if found == count:
        return None
    return f"{found} audio placeholders in the prompt, {count} audio embeddings"


def encode(model: nn.Module, prompt_ids: list[int], audio: AudioFeatures) -> MultimodalInput:
    """The MultimodalInput of a prompt whose placeholders are expanded: each clip through the audio
    encoder (in the engine's thread), the embeddings paired with the placeholders in order."""
    embeds = torch.cat([audio_embeddings(model, c.input_features, c.attention_mask) for c in audio.clips])
    placeholder = model.config.audio_token_id
    if (why := placeholder_mismatch(prompt_ids, placeholder, embeds.shape[0])) is not None:
        raise ValueError(why)
    positions = (torch.tensor(prompt_ids) == placeholder).nonzero().flatten()
    return MultimodalInput(embeds, positions, audio.digest)


def _qwen2_audio_embeds(model: nn.Module, input_features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Qwen2AudioModel.forward's audio path: encoder over the valid frames, projector, padding dropped."""
    from transformers.masking_utils import create_bidirectional_mask

    inner = model.model
    tower = inner.audio_tower
    features = input_features.to(tower.device, tower.dtype)
    enc_lengths, out_lengths = tower._get_feat_extract_output_lengths(mask.to(tower.device).sum(-1))
    max_len = (features.shape[-1] - 2) // 2 + 1
    valid = torch.arange(max_len, device=tower.device)[None, :] < enc_lengths[:, None]
    dummy = torch.zeros(features.shape[0], max_len, 1, dtype=features.dtype, device=tower.device)
    attention = create_bidirectional_mask(
        config=tower.config, inputs_embeds=dummy, attention_mask=valid.long()
    )
    hidden = inner.multi_modal_projector(tower(features, attention_mask=attention).last_hidden_state)
    keep = torch.arange(hidden.shape[1], device=hidden.device)[None, :] < out_lengths[:, None]
    return hidden[keep]


def place(embeds: torch.Tensor, mm: MultimodalInput, start: int, end: int) -> None:
    """Overwrite rows of ``embeds`` (the step's tokens at positions [start, end)) that are placeholders."""
    inside = (mm.positions >= start) & (mm.positions < end)
    if inside.any():
        rows = (mm.positions[inside] - start).to(embeds.device)
        embeds[rows] = mm.embeds[inside.to(mm.embeds.device)].to(embeds.device, embeds.dtype)


def forward_with_embeds(model: nn.Module, embeds: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor):
    """Logits [len(keep), vocab] of the decoder run on ``embeds`` [tokens, hidden]."""
    hidden = model.get_decoder()(inputs_embeds=embeds[None], position_ids=positions[None], use_cache=False)
    return model.get_output_embeddings()(hidden.last_hidden_state[0, keep])
