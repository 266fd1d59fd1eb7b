"""Audio-language models in the paged engine: embeddings that replace a prompt's placeholder tokens.

The model's own feature extractor and audio encoder (Qwen2-Audio and Voxtral: ``audio_tower`` +
``multi_modal_projector``) turn audio into one embedding per placeholder token; the prompt arrives
with its placeholders already expanded (as the model's processor does). From then on the request is
text to the scheduler: the runner embeds the step's tokens, overwrites the placeholder rows that fall
in the scheduled range (so chunked prefill works) and runs the decoder with keepwarm attention. The
audio's digest salts the prefix-cache hash chain, so the same text with other audio never shares KV.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from keepwarm_runtime.model_kind import AUDIO_LANGUAGE_MODELS


@dataclass(frozen=True)
class MultimodalInput:
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
            raise ValueError("qwen2_audio needs the feature extractor's attention mask")
        return _qwen2_audio_embeds(model, input_features, feature_attention_mask)
    if kind == "voxtral":
        tower = model.model.audio_tower
        features = input_features.to(tower.device, tower.dtype)
        return model.model.get_audio_features(features, return_dict=True).pooler_output
    raise ValueError(f"{kind} models take no audio input")


def multimodal_input(
    prompt_ids: list[int], embeds: torch.Tensor, placeholder_id: int, digest: int
) -> MultimodalInput:
    """Pair ``embeds`` with the prompt's ``placeholder_id`` tokens; ValueError when the counts differ."""
    positions = (torch.tensor(prompt_ids) == placeholder_id).nonzero().flatten()
    if positions.numel() != embeds.shape[0]:
        raise ValueError(
            f"{positions.numel()} audio placeholders in the prompt, {embeds.shape[0]} audio embeddings"
        )
    return MultimodalInput(embeds, positions, digest)


def encode_audio(
    model: nn.Module,
    prompt_ids: list[int],
    input_features: torch.Tensor,
    feature_attention_mask: torch.Tensor | None = None,
) -> MultimodalInput:
    """The MultimodalInput for a prompt whose ``audio_token_id`` placeholders are already expanded."""
    embeds = audio_embeddings(model, input_features, feature_attention_mask)
    extra = () if feature_attention_mask is None else (feature_attention_mask,)
    digest = media_digest(input_features, *extra)
    return multimodal_input(prompt_ids, embeds, model.config.audio_token_id, digest)


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
