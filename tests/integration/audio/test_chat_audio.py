"""Chat completions with audio parts on a real `keepwarm serve` of a tiny random Qwen2-Audio, through the
openai client, against transformers' generate() with the model's own processor on the same audio.

The server allow-lists 127.0.0.1 and one media directory, so ``audio_url`` http and file: URLs are
fetched from a real loopback HTTP server (tests/integration/audio/media_server.py) and real files,
and the attacks on that allow-list are refused with named OpenAI error bodies."""

from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openai
import pytest

from keepwarm_runtime.modelgen.qwen2_audio import make_qwen2_audio
from keepwarm_runtime.server.launcher import ServerProcess
from tests.integration.audio.media_server import MediaServer
from tests.integration.audio.serving import audio_server, noise_wav, openai_client

MODEL = "qwen2-audio-tiny"
MARKER = "<|audio_bos|><|AUDIO|><|audio_eos|>"
MAX_TOKENS = 10
MAX_MEDIA_BYTES = 200_000  # --max-audio-upload-bytes: caps fetched audio_url bodies too
FETCHED_SEED, FETCHED_SECONDS = 3, 1.2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_qwen2_audio(tmp_path_factory.mktemp("qwen2-audio") / "tiny-qwen2-audio")


@pytest.fixture(scope="module")
def media() -> MediaServer:
    data, _ = noise_wav(FETCHED_SEED, FETCHED_SECONDS)
    with MediaServer(data, big_bytes=2 * MAX_MEDIA_BYTES) as server:
        yield server


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The allowed directory: the fetched wav, a symlink out of it, and a secret beside it."""
    base = tmp_path_factory.mktemp("media")
    allowed = base / "allowed"
    allowed.mkdir()
    (allowed / "clip.wav").write_bytes(noise_wav(FETCHED_SEED, FETCHED_SECONDS)[0])
    (base / "secret.wav").write_bytes(noise_wav(99, 0.5)[0])
    (allowed / "escape.wav").symlink_to(base / "secret.wav")
    return allowed


@pytest.fixture(scope="module")
def server(model_dir: Path, media_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    log = tmp_path_factory.mktemp("qwen2-audio-log") / "serve.log"
    args = ["--served-model-name", MODEL, "--num-kv-blocks", "256", "--max-model-len", "1024"]
    args += ["--allowed-media-domains", "127.0.0.1", "--allowed-local-media-path", str(media_dir)]
    args += ["--max-audio-upload-bytes", str(MAX_MEDIA_BYTES), "--media-fetch-timeout", "60"]
    with audio_server(model_dir, log, args) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai_client(server)


def _reference(model_dir: Path, text: str, samples: np.ndarray) -> str:
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    processor = AutoProcessor.from_pretrained(model_dir)
    model = Qwen2AudioForConditionalGeneration.from_pretrained(model_dir).eval()
    rendered = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": MARKER + text}], tokenize=False, add_generation_prompt=True
    )
    inputs = processor(  # the template renders any BOS itself, as the server's render_chat assumes
        text=rendered, audio=[samples], sampling_rate=16000, return_tensors="pt", add_special_tokens=False
    )
    out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def _chat(client: openai.OpenAI, part: dict, text: str) -> str:
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": [part, {"type": "text", "text": text}]}],
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    return out.choices[0].message.content


def test_input_audio_matches_generate(client: openai.OpenAI, model_dir: Path) -> None:
    data, samples = noise_wav(1, 1.5)
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}}
    assert _chat(client, part, "What is this?") == _reference(model_dir, "What is this?", samples)


def test_audio_url_data_and_other_audio(client: openai.OpenAI, model_dir: Path) -> None:
    data, samples = noise_wav(2, 0.8)
    url = "data:audio/wav;base64," + base64.b64encode(data).decode()
    got = _chat(client, {"type": "audio_url", "audio_url": {"url": url}}, "Describe it.")
    assert got == _reference(model_dir, "Describe it.", samples)


@pytest.mark.parametrize(
    ("part", "message"),
    [
        ({"type": "audio_url", "audio_url": {"url": "https://example.com/a.wav"}}, "remote URLs"),
        ({"type": "audio_url", "audio_url": {"url": "file:///etc/passwd"}}, "outside"),
        ({"type": "audio_url", "audio_url": {"url": "/etc/passwd"}}, "data:, http(s): or file: URL"),
        ({"type": "input_audio", "input_audio": {"data": "!!notbase64", "format": "wav"}}, "base64"),
        ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "aiff"}}, "format"),
        (
            {
                "type": "input_audio",
                "input_audio": {"data": base64.b64encode(b"junk" * 50).decode(), "format": "wav"},
            },
            "cannot read",
        ),
    ],
)
def test_bad_audio_parts_are_400(client: openai.OpenAI, part: dict, message: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, part, "hi")
    assert message in info.value.response.json()["error"]["message"]


def _url_part(url: str) -> dict:
    return {"type": "audio_url", "audio_url": {"url": url}}


@pytest.fixture(scope="module")
def fetched_reference(model_dir: Path) -> str:
    return _reference(model_dir, "Describe it.", noise_wav(FETCHED_SEED, FETCHED_SECONDS)[1])


@pytest.mark.parametrize("path", ["/audio", "/same-origin"])
def test_allowed_http_url_matches_generate(
    client: openai.OpenAI, media: MediaServer, fetched_reference: str, path: str
) -> None:
    assert _chat(client, _url_part(media.url(path)), "Describe it.") == fetched_reference


def test_allowed_local_file_matches_generate(
    client: openai.OpenAI, media_dir: Path, fetched_reference: str
) -> None:
    assert _chat(client, _url_part((media_dir / "clip.wav").as_uri()), "Describe it.") == fetched_reference


def _refused(client: openai.OpenAI, url: str) -> tuple[int, dict]:
    with pytest.raises(openai.APIStatusError) as info:
        _chat(client, _url_part(url), "hi")
    return info.value.status_code, info.value.response.json()["error"]


def test_attacks_on_the_allow_list_are_refused_by_name(
    client: openai.OpenAI, media: MediaServer, media_dir: Path
) -> None:
    before = media.hits["/audio"]
    cases = {
        media.url("/audio", host="localhost"): (400, "media_url_not_allowed"),  # another host
        media.url("/other-origin"): (400, "media_redirect_refused"),  # redirect off the allow-list
        media.url("/big"): (413, "audio_too_large"),
        media.url("/undeclared"): (413, "audio_too_large"),  # no Content-Length: counted as it streams
        media.url("/missing"): (400, "media_fetch_failed"),
        f"file://{media_dir}/../secret.wav": (400, "media_url_not_allowed"),  # traversal
        (media_dir / "escape.wav").as_uri(): (400, "media_url_not_allowed"),  # symlink escape
    }
    for url, (status, code) in cases.items():
        got_status, error = _refused(client, url)
        assert (got_status, error["code"], error["type"]) == (status, code, "invalid_request_error"), url
        assert error["param"] == "messages.0.content.0"
    assert media.hits["/audio"] == before  # the refused hosts and redirects were never contacted


def test_a_slow_remote_does_not_hold_up_other_requests(client: openai.OpenAI, media: MediaServer) -> None:
    """/slow sends a few bytes, then waits until the test releases it: while it waits, another request
    (audio inline) is answered, so the fetch blocks neither the event loop nor the engine."""
    inline, _ = noise_wav(5, 0.5)
    part = {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(inline).decode(), "format": "wav"},
    }
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(_chat, client, _url_part(media.url("/slow")), "Describe it.")
        assert media.slow_started.wait(60)
        try:
            assert _chat(client, part, "And this?")
            assert not slow.done()  # still held by /slow: the answer above did not wait for it
        finally:
            media.release.set()
        assert slow.result(timeout=120)


def test_chat_audio_is_counted_in_the_audio_metrics(client: openai.OpenAI, server: ServerProcess) -> None:
    def counts() -> tuple[float, float]:
        metrics = server.metrics()
        decoded = sum(v for k, v in metrics.items() if k.startswith("keepwarm_audio_decode_seconds_count{"))
        return decoded, metrics.get("keepwarm_audio_processed_seconds_total", 0.0)

    before = counts()
    data, _ = noise_wav(6, 2.0)
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}}
    _chat(client, part, "Count me.")
    after = counts()
    assert after[0] == before[0] + 1
    assert after[1] == pytest.approx(before[1] + 2.0)
