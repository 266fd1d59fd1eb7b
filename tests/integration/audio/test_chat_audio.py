"""Chat completions with audio parts on a real `keepwarm serve` of a tiny random Qwen2-Audio, through the
openai client, against transformers' generate() with the model's own processor on the same audio."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import openai
import pytest

from keepwarm_runtime.server.launcher import ServerProcess, start_server
from tests.integration.audio.qwen2_audio_model import make_qwen2_audio

pytestmark = pytest.mark.integration
MODEL = "qwen2-audio-tiny"
MARKER = "<|audio_bos|><|AUDIO|><|audio_eos|>"
MAX_TOKENS = 10


def _wav(seed: int, seconds: float) -> tuple[bytes, np.ndarray]:
    import soundfile as sf

    samples = np.random.default_rng(seed).normal(0, 0.1, int(16000 * seconds)).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, samples, 16000, format="WAV", subtype="PCM_16")
    data = buf.getvalue()
    decoded, _ = sf.read(io.BytesIO(data), dtype="float32")
    return data, decoded


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_qwen2_audio(tmp_path_factory.mktemp("qwen2-audio") / "tiny-qwen2-audio")


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    log = tmp_path_factory.mktemp("qwen2-audio-log") / "serve.log"
    args = ["--served-model-name", MODEL, "--num-kv-blocks", "256", "--max-model-len", "1024"]
    proc = start_server(model_dir, log, args=args, env={"OMP_NUM_THREADS": "1"})
    try:
        proc.wait("/ready", timeout=240)
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


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
    data, samples = _wav(1, 1.5)
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}}
    assert _chat(client, part, "What is this?") == _reference(model_dir, "What is this?", samples)


def test_audio_url_data_and_other_audio(client: openai.OpenAI, model_dir: Path) -> None:
    data, samples = _wav(2, 0.8)
    url = "data:audio/wav;base64," + base64.b64encode(data).decode()
    got = _chat(client, {"type": "audio_url", "audio_url": {"url": url}}, "Describe it.")
    assert got == _reference(model_dir, "Describe it.", samples)


@pytest.mark.parametrize(
    ("part", "message"),
    [
        ({"type": "audio_url", "audio_url": {"url": "https://example.com/a.wav"}}, "remote URLs"),
        ({"type": "audio_url", "audio_url": {"url": "file:///etc/passwd"}}, "remote URLs"),
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
