"""A real `keepwarm serve` of a tiny random Whisper, driven by the official openai client.

The reference is transformers' generate() on the same samples (16 kHz PCM WAVs decode exactly with
any backend), run in this process.
"""

from __future__ import annotations

import io
import json
import os
import socket
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openai
import pytest

from keepwarm_runtime.modelgen.whisper import make_whisper
from keepwarm_runtime.server.launcher import ServerProcess
from tests.integration.audio.serving import audio_server, openai_client

MODEL = "whisper-tiny"
RATE = 16000
MAX_UPLOAD = 1_500_000


@dataclass
class Reference:
    model: object
    feature_extractor: object
    tokenizer: object
    eos: int

    def tokens(self, wav: bytes, language: str | None, task: str = "transcribe") -> list[int]:
        import soundfile as sf

        samples, rate = sf.read(io.BytesIO(wav), dtype="float32")
        assert rate == RATE
        features = self.feature_extractor(samples, sampling_rate=RATE, return_tensors="pt").input_features
        out = self.model.generate(features, language=language, task=task)[0].tolist()
        while out and out[-1] == self.eos:
            out.pop()
        return out

    def text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)


def wav(seed: int, seconds: float, rate: int = RATE) -> bytes:
    import soundfile as sf

    samples = np.random.default_rng(seed).normal(0, 0.1, int(rate * seconds)).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


@pytest.fixture(scope="module")
def whisper_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_whisper(tmp_path_factory.mktemp("whisper") / "tiny-whisper")


@pytest.fixture(scope="module")
def server(whisper_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    log = tmp_path_factory.mktemp("whisper-log") / "serve.log"
    args = ["--served-model-name", MODEL, "--max-num-seqs", "8", "--max-audio-upload-bytes", str(MAX_UPLOAD)]
    with audio_server(whisper_dir, log, args) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai_client(server)


@pytest.fixture(scope="module")
def reference(whisper_dir: Path) -> Reference:
    from transformers import AutoFeatureExtractor, AutoTokenizer, WhisperForConditionalGeneration

    model = WhisperForConditionalGeneration.from_pretrained(whisper_dir).eval()
    return Reference(
        model,
        AutoFeatureExtractor.from_pretrained(whisper_dir),
        AutoTokenizer.from_pretrained(whisper_dir),
        model.generation_config.eos_token_id,
    )


def test_transcription_matches_generate(client: openai.OpenAI, reference: Reference) -> None:
    audio = wav(1, 2.0)
    expected = reference.tokens(audio, "en")
    result = client.audio.transcriptions.create(model=MODEL, file=("a.wav", audio), language="en")
    assert result.text == reference.text(expected)
    verbose = client.audio.transcriptions.create(
        model=MODEL, file=("a.wav", audio), language="en", response_format="verbose_json"
    )
    assert verbose.segments[0].tokens == expected
    assert verbose.language == "english"
    assert verbose.duration == pytest.approx(2.0)


def test_concurrent_requests_each_match_generate(client: openai.OpenAI, reference: Reference) -> None:
    jobs = [(wav(10 + i, 0.5 + 0.5 * i), "en" if i % 2 else None) for i in range(6)]

    def transcribe(job: tuple[bytes, str | None]) -> list[int]:
        audio, language = job
        kwargs = {"language": language} if language else {}
        out = client.audio.transcriptions.create(
            model=MODEL, file=("c.wav", audio), response_format="verbose_json", **kwargs
        )
        return out.segments[0].tokens

    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(transcribe, jobs))
    for (audio, language), tokens in zip(jobs, results, strict=True):
        assert tokens == reference.tokens(audio, language)


def test_bad_requests_do_not_hurt_good_ones_in_flight(client: openai.OpenAI, reference: Reference) -> None:
    good = [wav(40 + i, 1.0) for i in range(3)]
    bad = [b"\x00garbage" * 50, wav(50, 2.0)[:10000], b""]

    def send(audio: bytes) -> list[int] | str:
        try:
            out = client.audio.transcriptions.create(
                model=MODEL, file=("x.wav", audio), language="en", response_format="verbose_json"
            )
        except openai.BadRequestError as exc:
            return _error(exc)["code"]
        return out.segments[0].tokens

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(send, [a for pair in zip(good, bad, strict=True) for a in pair]))
    assert results[1::2] == ["invalid_audio", "invalid_audio", "empty_audio"]
    assert results[0::2] == [reference.tokens(a, "en") for a in good]


def test_a_slow_upload_does_not_block_others(client: openai.OpenAI, server: ServerProcess) -> None:
    host, port = server.url.removeprefix("http://").split(":")
    slow = socket.create_connection((host, int(port)), timeout=10)
    try:
        head = (
            "POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\n"
            "Content-Type: multipart/form-data; boundary=b\r\nContent-Length: 100000\r\n\r\n--b\r\n"
        )
        slow.sendall(head.encode())  # ...and never the rest
        out = client.audio.transcriptions.create(model=MODEL, file=("a.wav", wav(60, 0.5)), language="en")
        assert isinstance(out.text, str)
    finally:
        slow.close()


def test_translation_matches_generate(client: openai.OpenAI, reference: Reference) -> None:
    audio = wav(2, 1.0)
    result = client.audio.translations.create(model=MODEL, file=("t.wav", audio))
    assert result.text == reference.text(reference.tokens(audio, None, task="translate"))


def test_text_srt_vtt(client: openai.OpenAI, reference: Reference) -> None:
    audio = wav(3, 1.5)
    text = reference.text(reference.tokens(audio, "fr"))
    common = {"model": MODEL, "file": ("f.wav", audio), "language": "fr"}
    assert client.audio.transcriptions.create(response_format="text", **common) == text
    srt = client.audio.transcriptions.create(response_format="srt", **common)
    assert srt == f"1\n00:00:00,000 --> 00:00:01,500\n{text.strip()}\n\n"
    vtt = client.audio.transcriptions.create(response_format="vtt", **common)
    assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> 00:00:01.500\n")


def test_streaming(client: openai.OpenAI, reference: Reference) -> None:
    audio = wav(4, 1.0)
    text = reference.text(reference.tokens(audio, "en"))
    events = list(
        client.audio.transcriptions.create(model=MODEL, file=("s.wav", audio), language="en", stream=True)
    )
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    assert len(deltas) > 1
    assert "".join(deltas) == text
    assert events[-1].type == "transcript.text.done" and events[-1].text == text


def test_other_formats_and_rates_decode(client: openai.OpenAI) -> None:
    import soundfile as sf

    samples = np.random.default_rng(5).normal(0, 0.1, (44100, 2)).astype(np.float32)
    for fmt, subtype in (("FLAC", "PCM_16"), ("MP3", "MPEG_LAYER_III"), ("OGG", "VORBIS")):
        buf = io.BytesIO()
        sf.write(buf, samples, 44100, format=fmt, subtype=subtype)
        out = client.audio.transcriptions.create(
            model=MODEL, file=(f"x.{fmt.lower()}", buf.getvalue()), response_format="verbose_json"
        )
        assert out.duration == pytest.approx(1.0, abs=0.05)


def _error(exc: openai.APIStatusError) -> dict:
    return exc.response.json()["error"]


@pytest.mark.parametrize(
    ("audio", "code"),
    [
        (b"\x00garbage" * 100, "invalid_audio"),
        (wav(6, 2.0)[:20000] + b"", "invalid_audio"),  # truncated: the header declares 2 s
        (b"", "empty_audio"),
        (wav(7, 31.0), "audio_too_long"),  # one Whisper window is 30 s
    ],
)
def test_bad_audio_is_a_400(client: openai.OpenAI, audio: bytes, code: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.audio.transcriptions.create(model=MODEL, file=("bad.wav", audio))
    assert _error(info.value)["code"] == code
    assert _error(info.value)["type"] == "invalid_request_error"


def test_upload_over_the_limit_is_a_413(client: openai.OpenAI, server: ServerProcess) -> None:
    with pytest.raises(openai.APIStatusError) as info:
        client.audio.transcriptions.create(model=MODEL, file=("big.wav", b"\0" * (MAX_UPLOAD + 1)))
    assert info.value.status_code == 413
    assert _error(info.value)["code"] == "audio_too_large"
    # Chunked (no Content-Length): refused as the bytes arrive.
    boundary = "kwb"
    head = f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="x.wav"\r\n\r\n'.encode()

    def body() -> Iterator[bytes]:  # a generator makes urllib send the body chunked
        yield head
        for _ in range(MAX_UPLOAD // 65536 + 2):
            yield b"\0" * 65536

    request = urllib.request.Request(
        server.url + "/v1/audio/transcriptions",
        data=body(),
        headers={"content-type": f"multipart/form-data; boundary={boundary}", "transfer-encoding": "chunked"},
    )
    with pytest.raises(urllib.error.HTTPError) as http:
        urllib.request.urlopen(request, timeout=30)
    assert http.value.code == 413
    assert json.loads(http.value.read())["error"]["code"] == "audio_too_large"


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"language": "xx"}, "language"),
        ({"prompt": "hello"}, "prompt"),
        ({"response_format": "xml"}, "response_format"),
        ({"temperature": 3.0}, "temperature"),
        ({"timestamp_granularities": ["word"], "response_format": "verbose_json"}, "timestamp_granularities"),
        ({"extra_body": {"beam_size": "5"}}, "beam_size"),
    ],
)
def test_unsupported_fields_are_refused_by_name(client: openai.OpenAI, kwargs: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.audio.transcriptions.create(model=MODEL, file=("a.wav", wav(8, 0.2)), **kwargs)
    assert _error(info.value)["param"] == param


def test_wrong_model_is_a_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.audio.transcriptions.create(model="other", file=("a.wav", wav(9, 0.2)))


def test_audio_metrics(client: openai.OpenAI, server: ServerProcess) -> None:
    client.audio.transcriptions.create(model=MODEL, file=("m.wav", wav(11, 1.0)), language="en")
    metrics = server.metrics()
    decoded = sum(v for k, v in metrics.items() if k.startswith("keepwarm_audio_decode_seconds_count{"))
    assert decoded >= 1
    assert any(
        'backend="torchcodec"' in k for k in metrics if k.startswith("keepwarm_audio_decode_seconds_count")
    )
    assert metrics["keepwarm_audio_processed_seconds_total"] >= 1.0
    assert server.proc.poll() is None
    assert os.path.exists(server.log_path)


def test_weights_attach_from_the_node_cache(
    whisper_dir: Path, reference: Reference, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from keepwarm_runtime.cache.launcher import DaemonProcess

    root = tmp_path_factory.mktemp("whisper-cache")
    daemon = DaemonProcess(root / "wc", [whisper_dir], "--dtype", "float32").wait_ready()
    args = ["--served-model-name", MODEL, "--cache-socket-dir", str(root / "wc"), "--no-cache-fallback"]
    try:
        with audio_server(whisper_dir, root / "serve.log", args) as proc:
            assert any(
                'source="cache"' in k for k in proc.metrics() if k.startswith("keepwarm_weight_load_seconds")
            )
            audio = wav(70, 1.0)
            out = openai_client(proc).audio.transcriptions.create(
                model=MODEL, file=("a.wav", audio), language="de", response_format="verbose_json"
            )
            assert out.segments[0].tokens == reference.tokens(audio, "de")
    finally:
        daemon.kill()
