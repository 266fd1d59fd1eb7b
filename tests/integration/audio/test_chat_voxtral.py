"""Chat completions with audio on a real `keepwarm serve` of a tiny random Voxtral whose tokenizer is
tekken.json (mistral-common, as real Voxtral checkpoints ship), through the openai client, against
transformers' VoxtralProcessor.apply_chat_template + generate() on the same audio; a text-only chat
in the same batch goes through tekken's own rendering as well (engine/chat.py)."""

from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from keepwarm_runtime.modelgen.voxtral import make_voxtral_tekken
from keepwarm_runtime.server.launcher import ServerProcess
from tests.integration.audio.serving import audio_server, noise_wav, openai_client

MODEL = "voxtral-tiny"
MAX_TOKENS = 8


def _wav(seed: int, seconds: float) -> str:
    """Base64 of a noise WAV (what both sides decode to the same samples)."""
    return base64.b64encode(noise_wav(seed, seconds)[0]).decode()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("mistral_common")
    return make_voxtral_tekken(tmp_path_factory.mktemp("voxtral") / "tiny-voxtral-tekken")


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    log = tmp_path_factory.mktemp("voxtral-log") / "serve.log"
    args = ["--served-model-name", MODEL, "--num-kv-blocks", "512", "--max-model-len", "2048"]
    with audio_server(model_dir, log, args) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai_client(server, timeout=180)


@pytest.fixture(scope="module")
def reference(model_dir: Path):
    from transformers import AutoProcessor, VoxtralForConditionalGeneration

    processor = AutoProcessor.from_pretrained(model_dir)
    model = VoxtralForConditionalGeneration.from_pretrained(model_dir).eval()

    def answer(content: list[dict]) -> list[int]:
        hf_content = [
            {"type": "audio", "base64": p["input_audio"]["data"]} if p["type"] == "input_audio" else p
            for p in content
        ]
        inputs = processor.apply_chat_template([{"role": "user", "content": hf_content}])
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
        return out[0, inputs["input_ids"].shape[1] :].tolist()

    return answer


def _audio(seed: int, seconds: float) -> dict:
    return {"type": "input_audio", "input_audio": {"data": _wav(seed, seconds), "format": "wav"}}


def _chat(client: openai.OpenAI, content: list[dict], **kw: object) -> list[int]:
    """The answer's token ids (the byte-level tiny vocabulary rarely makes whole UTF-8 text)."""
    extra = {"return_tokens_as_token_ids": True} | dict(kw.pop("extra_body", {}))
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        temperature=0,
        max_tokens=MAX_TOKENS,
        logprobs=True,
        extra_body=extra,
        **kw,
    )
    return [int(t.token.removeprefix("token_id:")) for t in out.choices[0].logprobs.content]


CONVERSATIONS = {
    "one audio": [_audio(1, 1.5), {"type": "text", "text": "What is this?"}],
    "two audios": [
        {"type": "text", "text": "Compare "},
        _audio(2, 0.7),
        {"type": "text", "text": " with "},
        _audio(3, 2.0),
    ],
    "two chunks": [_audio(4, 31.0), {"type": "text", "text": "Summarise."}],  # over 30 s: two windows
    "text only": [{"type": "text", "text": "Hello there"}],  # rendered by tekken too, batched with audio
}


def test_concurrent_audio_chats_match_generate(client: openai.OpenAI, reference) -> None:
    with ThreadPoolExecutor(len(CONVERSATIONS)) as pool:
        answers = dict(
            zip(CONVERSATIONS, pool.map(lambda c: _chat(client, c), CONVERSATIONS.values()), strict=True)
        )
    for name, content in CONVERSATIONS.items():
        assert answers[name] and answers[name] == reference(content), name


def test_what_mistral_common_cannot_render_is_refused_by_name(client: openai.OpenAI) -> None:
    content = CONVERSATIONS["one audio"]
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, content, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    error = info.value.response.json()["error"]
    assert error["param"] == "chat_template_kwargs.enable_thinking"
    assert "mistral-common renders the chat itself" in error["message"]
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, content, extra_body={"add_generation_prompt": False})
    assert info.value.response.json()["error"]["param"] == "add_generation_prompt"


def test_encoder_and_decoder_weights_attach_from_the_node_cache(
    model_dir: Path, reference, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """--no-cache-fallback: every weight, the audio encoder's and projector's included, comes from the
    node cache daemon, and the answer is still generate()'s."""
    from keepwarm_runtime.cache.launcher import DaemonProcess

    root = tmp_path_factory.mktemp("voxtral-cache")
    daemon = DaemonProcess(root / "wc", [model_dir], "--dtype", "float32").wait_ready()
    args = ["--served-model-name", MODEL, "--cache-socket-dir", str(root / "wc"), "--no-cache-fallback"]
    try:
        with audio_server(model_dir, root / "serve.log", args) as proc:
            assert any(
                'source="cache"' in k for k in proc.metrics() if k.startswith("keepwarm_weight_load_seconds")
            )
            content = CONVERSATIONS["one audio"]
            assert _chat(openai_client(proc, timeout=180), content) == reference(content)
    finally:
        daemon.kill()
