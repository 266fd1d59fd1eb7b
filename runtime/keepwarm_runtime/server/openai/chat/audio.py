"""Chat ``input_audio`` and ``audio_url`` content parts for audio-language models.

Each audio part becomes the model's audio marker in the message text (Qwen2-Audio:
``<|audio_bos|><|AUDIO|><|audio_eos|>``; Voxtral: ``[BEGIN_AUDIO][AUDIO]``); after the chat template
renders, each placeholder token is expanded to as many copies as the audio will have embeddings
(the engine's ``capabilities.audio`` counts them from the features), and the features travel with the
request as ``AudioFeatures``: the server decodes and runs the feature extractor in worker threads, the
engine runs the audio encoder in its own step (engine/multimodal.py). Voxtral checkpoints that ship
tekken.json render through mistral-common instead (audio_mistral.py). ``audio_url`` takes ``data:``
URLs; http(s) and ``file:`` URLs only where the server's allow-lists name them
(server/base/media_fetch.py), and by default this server never fetches media.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from keepwarm_runtime.audio import AudioError, load_audio
from keepwarm_runtime.engine.chat import is_mistral_common
from keepwarm_runtime.engine.multimodal import (
    AudioClip,
    AudioFeatures,
    AudioSpec,
    audio_features,
    placeholder_mismatch,
)
from keepwarm_runtime.server.base.errors import BadRequest
from keepwarm_runtime.server.base.media_fetch import MediaPolicy, fetch_media
from keepwarm_runtime.server.base.protocol import ChatMessage, TextContentPart
from keepwarm_runtime.server.openai.chat.audio_mistral import mistral_audio_prompt

if TYPE_CHECKING:
    from keepwarm_runtime.server.engine_client import EngineClient

AUDIO_PART_TYPES = ("input_audio", "audio_url")
AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg")  # input_audio.format values accepted
# model_type -> text that stands for one audio in a message (containing the placeholder token once).
AUDIO_MARKERS = {
    "qwen2_audio": "<|audio_bos|><|AUDIO|><|audio_eos|>",
    "voxtral": "[BEGIN_AUDIO][AUDIO]",
}
_ROLES = {"developer": "system"}


@dataclass(frozen=True)
class AudioRef:
    """An ``audio_url`` that is not a ``data:`` URL: fetched (or refused) by ``resolve_audio``."""

    url: str
    where: str  # the content part, for the error's param


def has_audio_parts(messages: list[ChatMessage]) -> bool:
    return any(
        isinstance(m.content, list) and any(p.get("type") in AUDIO_PART_TYPES for p in m.content)
        for m in messages
    )


def split_parts(messages: list[ChatMessage]) -> tuple[list[dict[str, Any]], list[bytes | AudioRef]]:
    """(messages whose content is a string, or a list of text strings and ints: the index of an audio
    in the second list; the audio files or references in order)."""
    rendered: list[dict[str, Any]] = []
    audios: list[bytes | AudioRef] = []
    for i, message in enumerate(messages):
        role = _ROLES.get(message.role, message.role)
        if not isinstance(message.content, list):
            rendered.append({"role": role, "content": message.content or ""})
            continue
        pieces: list[str | int] = []
        for j, part in enumerate(message.content):
            kind, where = part.get("type"), f"messages.{i}.content.{j}"
            if kind == "text":
                pieces.append(TextContentPart.model_validate(part).text)
            elif kind in AUDIO_PART_TYPES:
                pieces.append(len(audios))
                audios.append(_audio_bytes(part, where))
            else:
                raise BadRequest(
                    f"content part type {kind!r} is not supported; send text or audio", param=where
                )
        rendered.append({"role": role, "content": pieces})
    return rendered, audios


def split_audio(
    messages: list[ChatMessage], marker: str
) -> tuple[list[dict[str, str]], list[bytes | AudioRef]]:
    """(template messages with ``marker`` where each audio was, the audio files or references in order)."""
    parts, audios = split_parts(messages)
    return with_markers(parts, marker), audios


def with_markers(parts: list[dict[str, Any]], marker: str) -> list[dict[str, str]]:
    """split_parts' messages with ``marker`` in place of each audio index."""
    return [
        m | {"content": "".join(marker if isinstance(p, int) else p for p in m["content"])}
        if isinstance(m["content"], list)
        else m
        for m in parts
    ]


def _audio_bytes(part: dict[str, Any], where: str) -> bytes | AudioRef:
    if part["type"] == "input_audio":
        spec = part.get("input_audio")
        if not isinstance(spec, dict) or not isinstance(spec.get("data"), str):
            raise BadRequest("input_audio needs {data: base64, format}", param=where)
        if spec.get("format") not in AUDIO_FORMATS:
            raise BadRequest(f"input_audio.format must be one of {', '.join(AUDIO_FORMATS)}", param=where)
        return _b64(spec["data"], where)
    spec = part.get("audio_url")
    url = spec.get("url") if isinstance(spec, dict) else None
    if not isinstance(url, str):
        raise BadRequest("audio_url needs {url: string}", param=where)
    if not url.startswith("data:"):
        return AudioRef(url, where)
    header, _, payload = url.partition(",")
    if not header.endswith(";base64"):
        raise BadRequest("audio_url data: URLs must be base64", param=where)
    return _b64(payload, where)


def _b64(text: str, where: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BadRequest(f"audio data is not valid base64: {exc}", param=where) from exc


async def resolve_audio(sources: list[bytes | AudioRef], policy: MediaPolicy | None) -> list[bytes]:
    """The audio files, references fetched under ``policy`` (None: every reference refused)."""
    policy = policy or MediaPolicy()  # one after the other: a refusal leaves no fetch running behind it
    return [s if isinstance(s, bytes) else await fetch_media(s.url, policy, s.where) for s in sources]


@functools.lru_cache(maxsize=4)
def _feature_extractor(model_dir: str) -> Any:
    from transformers import AutoFeatureExtractor

    return AutoFeatureExtractor.from_pretrained(model_dir)


def _decode(audio: bytes, sample_rate: int, max_duration_s: float | None, settings: Any) -> Any:
    try:
        return load_audio(
            audio,
            sample_rate=sample_rate,
            max_duration_s=max_duration_s,
            max_decoded_bytes=getattr(settings, "max_decoded_bytes", None),
            backend=getattr(settings, "backend", None),
        )
    except AudioError as exc:
        raise BadRequest(str(exc), param="messages", code=exc.code) from exc


def _extract(extractor: Any, samples: torch.Tensor) -> AudioClip:
    """One audio's features (and attention mask, where the extractor gives one); blocking."""
    features = extractor(
        samples.numpy(),
        sampling_rate=extractor.sampling_rate,
        return_attention_mask=True,
        return_tensors="pt",
    )
    return AudioClip(features.input_features, features.get("attention_mask"))


async def audio_chat_prompt(
    engine: EngineClient,
    model_dir: Path,
    messages: list[ChatMessage],
    *,
    settings: Any,
    metrics: Any,
    **render: Any,
) -> tuple[list[int], AudioFeatures]:
    """(prompt ids with expanded placeholders, AudioFeatures) for a chat with audio parts.
    ``settings``: the server's AudioServerSettings (backend, limits, media allow-lists), or None for
    the defaults. Decoding and features run in worker threads, never on the loop; the audio encoder
    runs in the engine's step."""
    spec = engine.capabilities.audio
    if spec is None:
        raise BadRequest("this model does not take audio input", param="messages", code="model_not_supported")
    parts, sources = split_parts(messages)
    audios = await resolve_audio(sources, getattr(settings, "media", None))
    extractor = _feature_extractor(str(model_dir))
    mistral = is_mistral_common(engine.tokenizer)
    # Voxtral's processor splits long audio into 30 s chunks; the marker route encodes one window.
    max_duration_s = None if mistral else float(extractor.chunk_length)
    decoded = []
    for audio in audios:
        decoded.append(
            await asyncio.to_thread(_decode, audio, extractor.sampling_rate, max_duration_s, settings)
        )
        if metrics is not None:
            metrics.record(decoded[-1].backend, decoded[-1].decode_seconds, decoded[-1].duration_s)
    if mistral:
        samples = [d.samples.numpy() for d in decoded]
        ids, features = await asyncio.to_thread(
            mistral_audio_prompt, engine.tokenizer, extractor, parts, samples, **render
        )
        clips = [AudioClip(features)]
        _check_placeholders(ids, spec, clips)
        return ids, await asyncio.to_thread(audio_features, clips)
    clips = [await asyncio.to_thread(_extract, extractor, d.samples) for d in decoded]
    template_messages = with_markers(parts, AUDIO_MARKERS[spec.model_type])
    ids = await asyncio.to_thread(_render_template, engine.tokenizer, template_messages, render)
    expanded = _expand(ids, spec.placeholder_id, [spec.count(c) for c in clips])
    return expanded, await asyncio.to_thread(audio_features, clips)


def _render_template(tokenizer: Any, messages: list[dict[str, str]], render: dict[str, Any]) -> list[int]:
    from keepwarm_runtime.engine.chat import render_chat

    try:
        return render_chat(tokenizer, messages, **render)
    except Exception as exc:  # the template raised (jinja errors, bad roles)
        raise BadRequest(f"cannot apply the chat template: {exc}", param="messages") from exc


def _check_placeholders(ids: list[int], spec: AudioSpec, clips: list[AudioClip]) -> None:
    """A processor whose expansion disagrees with the encoder's count is a 400, before the engine."""
    why = placeholder_mismatch(ids, spec.placeholder_id, sum(spec.count(c) for c in clips))
    if why is not None:
        raise BadRequest(why, param="messages")


def _expand(ids: list[int], placeholder: int, counts: list[int]) -> list[int]:
    """Each placeholder occurrence k becomes counts[k] copies; 400 if the template lost or added some."""
    if ids.count(placeholder) != len(counts):
        raise BadRequest(
            f"the rendered chat has {ids.count(placeholder)} audio placeholders, {len(counts)} audio parts",
            param="messages",
        )
    out, k = [], 0
    for token in ids:
        if token == placeholder:
            out += [placeholder] * counts[k]
            k += 1
        else:
            out.append(token)
    return out
