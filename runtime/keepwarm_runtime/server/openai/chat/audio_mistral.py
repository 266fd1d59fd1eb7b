"""Chat with audio for Voxtral checkpoints that ship ``tekken.json`` (mistral-common's tokenizer).

Real Voxtral checkpoints have no Jinja chat template: their tokenizer is mistral-common's tekken
(transformers' ``MistralCommonBackend``), which renders the conversation itself and expands each audio
into ``[BEGIN_AUDIO]`` plus one ``[AUDIO]`` per 80 ms of audio padded to whole 30 s chunks. The
marker-in-text route of audio.py cannot work there (tekken encodes special-token strings found in
text as plain bytes), so the conversation goes to transformers' ``VoxtralProcessor``, the model's own
processor, which returns the prompt ids and the chunked features together. The audio it sees is what
keepwarm decoded (its backends and guards), re-encoded as float WAV, which mistral-common reads back
sample for sample; no URL or path ever reaches mistral-common, so it never fetches anything.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import torch

from keepwarm_runtime.server.base.errors import BadRequest


def _float_wav(samples: np.ndarray, sample_rate: int) -> str:
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, samples, sample_rate, format="WAV", subtype="FLOAT")
    return base64.b64encode(buf.getvalue()).decode()


def conversation(
    parts: list[dict[str, Any]], samples: list[np.ndarray], sample_rate: int
) -> list[dict[str, Any]]:
    """split_parts' messages as transformers' multimodal chat: audio index k becomes samples[k]."""
    out = []
    for message in parts:
        content = message["content"]
        if isinstance(content, list):
            content = [
                {"type": "audio", "base64": _float_wav(samples[p], sample_rate)}
                if isinstance(p, int)
                else {"type": "text", "text": p}
                for p in content
            ]
        out.append({"role": message["role"], "content": content})
    return out


def mistral_audio_prompt(
    tokenizer: Any,
    extractor: Any,
    parts: list[dict[str, Any]],
    samples: list[np.ndarray],
    *,
    add_generation_prompt: bool = True,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> tuple[list[int], torch.Tensor]:
    """(prompt ids with the audio tokens expanded, input features [chunks, mels, frames]); blocking."""
    from transformers import VoxtralProcessor

    kwargs = dict(chat_template_kwargs or {})
    continue_final = bool(kwargs.pop("continue_final_message", False))
    if kwargs:
        names = sorted(kwargs)
        raise BadRequest(
            f"{', '.join(names)}: not supported with this model's tokenizer (mistral-common renders the "
            "chat itself, without a chat template)",
            param=names[0] if names[0] in ("tools", "chat_template") else f"chat_template_kwargs.{names[0]}",
        )
    if not add_generation_prompt and not continue_final:
        raise BadRequest(
            "this model's tokenizer always ends a user turn ready for the answer: add_generation_prompt "
            "false needs continue_final_message true",
            param="add_generation_prompt",
        )
    processor = VoxtralProcessor(feature_extractor=extractor, tokenizer=tokenizer)
    chat = conversation(parts, samples, extractor.sampling_rate)
    try:
        out = processor.apply_chat_template(chat, continue_final_message=continue_final)
    except Exception as exc:  # mistral-common's request validation (roles, order) raises many types
        raise BadRequest(f"cannot render the chat: {exc}", param="messages") from exc
    return out["input_ids"][0].tolist(), out["input_features"]
