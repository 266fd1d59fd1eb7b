"""POST /v1/audio/transcriptions and /v1/audio/translations: OpenAI's multipart forms over WhisperEngine.

The upload is read with a byte cap (413 past it), decoded by ``load_audio`` in a worker thread (the
event loop never decodes), turned into features there too, then joins the engine's batch like any
request. Every form field OpenAI defines is honoured or refused by name; unknown fields are refused.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from keepwarm_api.settings import flag_name
from keepwarm_runtime.audio import AudioError, load_audio
from keepwarm_runtime.audio.metrics import AudioMetrics
from keepwarm_runtime.audio.transcript_formats import (
    RESPONSE_FORMATS,
    TEXT_FORMATS,
    Transcript,
    as_json,
    as_srt,
    as_verbose_json,
    as_vtt,
)
from keepwarm_runtime.model_kind import ModelKind
from keepwarm_runtime.server.base.errors import APIError, BadRequest, PayloadTooLarge
from keepwarm_runtime.server.base.limits import DEFAULT_MAX_MEDIA_BYTES
from keepwarm_runtime.server.base.media_fetch import MediaPolicy
from keepwarm_runtime.server.base.metrics import RequestTimer
from keepwarm_runtime.server.base.protocol import random_id
from keepwarm_runtime.server.base.routes import Route
from keepwarm_runtime.server.base.serving import ServingContext, race_disconnect
from keepwarm_runtime.server.base.sse import sse_event

if TYPE_CHECKING:
    from keepwarm_runtime.engine.config import EngineConfig

logger = logging.getLogger(__name__)
TRANSCRIPTIONS, TRANSLATIONS = "/v1/audio/transcriptions", "/v1/audio/translations"
DEFAULT_MAX_UPLOAD_BYTES = DEFAULT_MAX_MEDIA_BYTES  # OpenAI's limit
_COMMON_FIELDS = {"file", "model", "prompt", "response_format", "temperature"}
_FIELDS = {
    "transcribe": _COMMON_FIELDS
    | {"language", "stream", "timestamp_granularities[]", "timestamp_granularities", "include[]", "include"},
    "translate": _COMMON_FIELDS,
}
_TRUE, _FALSE = {"true", "1"}, {"false", "0", ""}


@dataclass(frozen=True)
class AudioServerSettings:
    backend: str | None = None  # load_audio backend; None: KEEPWARM_AUDIO_BACKEND or auto
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES  # the whole multipart body
    max_decoded_bytes: int = 64 * 1024 * 1024  # float32 samples after decoding
    media: MediaPolicy = field(
        default_factory=MediaPolicy
    )  # where chat audio_url may point (default: data: URLs only)


@dataclass(frozen=True)
class _Form:
    data: bytes
    task: str
    language: str | None
    response_format: str
    temperature: float
    stream: bool


def audio_settings(
    backend: str | None, max_upload_bytes: int, kind: ModelKind, media: MediaPolicy | None = None
) -> AudioServerSettings:
    """Start-up checks: an unknown backend name is a ValueError listing the valid ones; for a speech
    model, a backend that cannot load is a RuntimeError. Logs the choice once. ``backend`` is
    --audio-backend as the settings resolved it (KEEPWARM_AUDIO_BACKEND included; None: auto): the
    environment is not read again here."""
    from keepwarm_runtime.audio import AUTO, check_backend
    from keepwarm_runtime.audio.settings import validate_backend

    name = validate_backend(backend or AUTO)
    if max_upload_bytes <= 0:
        raise ValueError(f"--max-audio-upload-bytes must be positive (got {max_upload_bytes})")
    if kind is ModelKind.SPEECH:
        check_backend(name)
        require_multipart()
        logger.info("audio: backend %s, uploads up to %d bytes", name, max_upload_bytes)
    media = media or MediaPolicy(max_bytes=max_upload_bytes)
    if media.domains or media.local_root:
        logger.info(
            "audio_url: fetching from hosts %s, local files under %s",
            sorted(media.domains) or "none",
            media.local_root or "none",
        )
    return AudioServerSettings(backend=name, max_upload_bytes=max_upload_bytes, media=media)


def make_speech_engine(config: EngineConfig, kind: ModelKind) -> Any:
    """A WhisperEngine of ``config`` for a speech model, else None.

    WhisperEngine's keyword arguments are named as EngineConfig's fields, so its signature says what it
    takes: the settings the user gave (``config.given``) are passed to it, one it has no argument for
    is refused by its flag, and the ones not given keep WhisperEngine's own defaults."""
    if kind is not ModelKind.SPEECH:
        return None
    from keepwarm_runtime.audio.whisper_engine import WhisperEngine

    given = config.given_values()
    takes = {p.name for p in inspect.signature(WhisperEngine).parameters.values() if p.kind is p.KEYWORD_ONLY}
    refused = sorted(name for name in given if name not in takes)
    if refused:
        raise ValueError(
            f"not supported for Whisper models: {', '.join(flag_name(name) for name in refused)}"
        )
    return WhisperEngine(config.model_dir, **given)


async def transcriptions(raw: Request) -> Any:
    state = raw.app.state
    return await _serve(state.ctx, state.audio_settings, state.audio_metrics, raw, "transcribe")


async def translations(raw: Request) -> Any:
    state = raw.app.state
    return await _serve(state.ctx, state.audio_settings, state.audio_metrics, raw, "translate")


async def _serve(
    ctx: ServingContext, settings: AudioServerSettings, metrics: AudioMetrics, raw: Request, task: str
) -> Any:
    arrival = time.perf_counter()
    engine = ctx.engine
    if not engine.capabilities.transcription:
        raise BadRequest(
            f"the model `{ctx.served_model_name}` does not transcribe audio",
            param="model",
            code="model_not_supported",
        )
    form = await _read_form(ctx, raw, task, settings.max_upload_bytes)
    from keepwarm_runtime.audio.whisper_engine import TranscriptionParams

    params = TranscriptionParams(task=task, language=form.language, temperature=form.temperature)
    try:
        engine.check_params(params)
    except ValueError as exc:
        raise BadRequest(
            str(exc), param="language" if "language" in str(exc) else None, code="invalid_value"
        ) from exc
    try:
        audio = await asyncio.to_thread(
            load_audio,
            form.data,
            sample_rate=engine.sample_rate,
            max_duration_s=engine.max_audio_seconds,
            max_decoded_bytes=settings.max_decoded_bytes,
            backend=settings.backend,
        )
    except AudioError as exc:
        raise BadRequest(str(exc), param="file", code=exc.code) from exc
    metrics.record(audio.backend, audio.decode_seconds, audio.duration_s)
    features = await asyncio.to_thread(engine.features, audio.samples)
    request_id = random_id("trsc")
    outputs = ctx.stream(request_id, features, params, RequestTimer(ctx.metrics, 0, arrival=arrival))
    if form.stream:
        first = await race_disconnect(anext(outputs), raw)
        return StreamingResponse(_events(first, outputs), media_type="text/event-stream")
    final = await race_disconnect(_last(outputs), raw)
    completion = final.outputs[0]
    transcript = Transcript(
        task=task,
        language=final.language,
        duration_s=audio.duration_s,
        text=completion.text,
        token_ids=completion.token_ids,
        sum_logprob=completion.cumulative_logprob or 0.0,
        temperature=form.temperature,
    )
    return _render(transcript, form.response_format)


def _render(t: Transcript, response_format: str) -> Any:
    if response_format == "json":
        return JSONResponse(as_json(t))
    if response_format == "verbose_json":
        return JSONResponse(as_verbose_json(t))
    render = {"text": lambda t: t.text, "srt": as_srt, "vtt": as_vtt}[response_format]
    return PlainTextResponse(render(t), media_type=TEXT_FORMATS[response_format])


async def _last(outputs: AsyncIterator[Any]) -> Any:
    final = None
    async for final in outputs:  # noqa: B007 - the last one is the answer
        pass
    return final


async def _events(first: Any, outputs: AsyncIterator[Any]) -> AsyncIterator[str]:
    """OpenAI's transcription stream: ``transcript.text.delta`` events, then ``transcript.text.done``."""
    sent = ""
    output = first
    while True:
        text = output.outputs[0].text
        if text.startswith(sent) and len(text) > len(sent):
            yield sse_event({"type": "transcript.text.delta", "delta": text[len(sent) :]})
            sent = text
        if output.finished:
            yield sse_event({"type": "transcript.text.done", "text": text})
            return
        output = await anext(outputs)


def require_multipart() -> None:
    """RuntimeError naming the extra when python-multipart (form parsing) is missing."""
    from starlette import formparsers

    if formparsers.multipart is None:
        raise RuntimeError("audio uploads need python-multipart: install keepwarm-runtime[audio]")


async def _read_form(ctx: ServingContext, raw: Request, task: str, max_bytes: int) -> _Form:
    try:
        require_multipart()
    except RuntimeError as exc:
        raise APIError(str(exc), code="audio_extra_missing") from exc
    if not raw.headers.get("content-type", "").startswith("multipart/form-data"):
        raise BadRequest(
            "send the audio as multipart/form-data with a `file` field", code="invalid_content_type"
        )
    declared = raw.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise PayloadTooLarge(
            f"the upload is {declared} bytes; the limit is {max_bytes}", code="audio_too_large"
        )
    parser = MultiPartParser(raw.headers, _capped(raw, max_bytes), max_files=1, max_fields=32)
    try:
        form = await parser.parse()
    except MultiPartException as exc:
        raise BadRequest(f"malformed multipart body: {exc.message}", code="invalid_multipart") from exc
    try:
        return await _parse_fields(ctx, form, task)
    finally:
        await form.close()


async def _capped(raw: Request, max_bytes: int) -> AsyncIterator[bytes]:
    """The request body, refused with 413 as soon as it passes ``max_bytes`` (chunked uploads too)."""
    total = 0
    async for chunk in raw.stream():
        total += len(chunk)
        if total > max_bytes:
            raise PayloadTooLarge(
                f"the upload is over the limit of {max_bytes} bytes", code="audio_too_large"
            )
        yield chunk


async def _parse_fields(ctx: ServingContext, form: Any, task: str) -> _Form:
    unknown = sorted(set(form.keys()) - _FIELDS[task])
    if unknown:
        raise BadRequest(f"unknown field(s) for this endpoint: {', '.join(unknown)}", param=unknown[0])
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise BadRequest("the `file` field (an audio file) is required", param="file", code="missing_file")
    model = _text(form, "model")
    if not model:
        raise BadRequest("the `model` field is required", param="model", code="missing_model")
    ctx.check_model(model)
    if _text(form, "prompt"):
        raise BadRequest(
            "`prompt` is not supported by this server", param="prompt", code="unsupported_parameter"
        )
    for name in ("include[]", "include"):
        if form.getlist(name):
            raise BadRequest(
                f"`include` ({', '.join(map(str, form.getlist(name)))}) is not supported", param=name
            )
    response_format = _text(form, "response_format") or "json"
    if response_format not in RESPONSE_FORMATS:
        raise BadRequest(
            f"response_format must be one of {', '.join(RESPONSE_FORMATS)}", param="response_format"
        )
    granularities = [
        str(g) for n in ("timestamp_granularities[]", "timestamp_granularities") for g in form.getlist(n)
    ]
    if granularities and response_format != "verbose_json":
        raise BadRequest(
            "timestamp_granularities needs response_format=verbose_json", param="timestamp_granularities"
        )
    if any(g != "segment" for g in granularities):
        raise BadRequest("only segment timestamps are supported (not word)", param="timestamp_granularities")
    stream = _flag(form, "stream")
    if stream and response_format not in ("json", "text"):
        raise BadRequest("stream needs response_format json or text", param="stream")
    return _Form(
        data=await upload.read(),
        task=task,
        language=_text(form, "language") or None,
        response_format=response_format,
        temperature=_temperature(form),
        stream=stream,
    )


def _text(form: Any, name: str) -> str:
    value = form.get(name)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise BadRequest(f"`{name}` must be a plain form field, not a file", param=name)
    return value.strip()


def _flag(form: Any, name: str) -> bool:
    value = _text(form, name).lower()
    if value not in _TRUE | _FALSE:
        raise BadRequest(f"`{name}` must be true or false", param=name)
    return value in _TRUE


def _temperature(form: Any) -> float:
    raw = _text(form, "temperature")
    try:
        value = float(raw) if raw else 0.0
    except ValueError:
        raise BadRequest("temperature must be a number between 0 and 1", param="temperature") from None
    if not 0.0 <= value <= 1.0:
        raise BadRequest("temperature must be between 0 and 1", param="temperature", code="invalid_value")
    return value


ROUTES = (
    Route(TRANSCRIPTIONS, "POST", transcriptions, inference=True, own_body_limit=True),
    Route(TRANSLATIONS, "POST", translations, inference=True, own_body_limit=True),
)
