"""A tiny random Qwen2-Audio through the paged engine, against transformers' generate() on the same audio.

Requests carry the feature extractor's output (AudioFeatures); the engine's step runs the audio encoder,
and a request whose audio the encoder cannot take fails alone, the engine and the others carrying on."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from keepwarm_runtime import SamplingParams
from keepwarm_runtime.engine.config import EngineConfig
from keepwarm_runtime.engine.llm_engine import LLMEngine
from keepwarm_runtime.engine.multimodal import AudioClip, AudioFeatures, audio_features
from keepwarm_runtime.engine.outputs import RequestOutput
from keepwarm_runtime.modelgen.qwen2_audio import make_qwen2_audio
from keepwarm_runtime.server.async_engine import AsyncEngine, EngineRequestError

MAX_TOKENS = 12
PROMPT = "<|audio_bos|><|AUDIO|><|audio_eos|>What is this sound?"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_qwen2_audio(tmp_path_factory.mktemp("qwen2-audio") / "tiny-qwen2-audio")


@pytest.fixture(scope="module")
def hf(model_dir: Path):
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    return AutoProcessor.from_pretrained(model_dir), Qwen2AudioForConditionalGeneration.from_pretrained(
        model_dir
    ).eval()


def _engine(model_dir: Path, **overrides: int) -> LLMEngine:
    return LLMEngine(EngineConfig(str(model_dir), **({"num_kv_blocks": 128, "block_size": 8} | overrides)))


def _audio(seed: int, seconds: float) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 0.1, int(16000 * seconds)).astype(np.float32)


def _inputs(hf, audio: np.ndarray, text: str = PROMPT) -> dict:
    processor, _ = hf
    return processor(text=text, audio=[audio], sampling_rate=16000, return_tensors="pt")


def _reference(hf, inputs: dict) -> list[int]:
    _, model = hf
    out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def _run(engine: LLMEngine) -> dict:
    finals = {}
    while engine.has_unfinished_requests():
        finals |= {o.request_id: o for o in engine.step() if o.finished}
    return finals


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def _features(inputs: dict) -> AudioFeatures:
    return audio_features([AudioClip(inputs["input_features"], inputs["feature_attention_mask"])])


def _add_audio(engine: LLMEngine, request_id: str, inputs: dict) -> None:
    engine.add_request(request_id, inputs["input_ids"][0].tolist(), _greedy(), audio=_features(inputs))


def _unencodable(inputs: dict) -> AudioFeatures:
    """Features with half the mel bins the encoder's first convolution takes, and an intact mask: the
    placeholders still match, the encoder raises."""
    features, mask = inputs["input_features"], inputs["feature_attention_mask"]
    return audio_features([AudioClip(features[:, : features.shape[1] // 2], mask)])


def test_audio_requests_batched_with_text_requests_match_generate(model_dir: Path, hf) -> None:
    engine = _engine(model_dir)
    audio_inputs = {f"a{i}": _inputs(hf, _audio(i, 0.6 + 0.7 * i)) for i in range(3)}
    texts = {"t0": "def main():", "t1": "import os\nimport sys"}
    processor, model = hf
    for request_id, inputs in audio_inputs.items():
        _add_audio(engine, request_id, inputs)
    for request_id, text in texts.items():
        engine.add_request(request_id, processor.tokenizer(text).input_ids, _greedy())
    finals = _run(engine)
    for request_id, inputs in audio_inputs.items():
        assert finals[request_id].outputs[0].token_ids == _reference(hf, inputs)
    for request_id, text in texts.items():
        ids = processor.tokenizer(text, return_tensors="pt").input_ids
        expected = model.generate(input_ids=ids, max_new_tokens=MAX_TOKENS, do_sample=False)[
            0, ids.shape[1] :
        ]
        assert finals[request_id].outputs[0].token_ids == expected.tolist()


def test_chunked_prefill_splits_the_audio_embeddings(model_dir: Path, hf) -> None:
    engine = _engine(model_dir, max_num_batched_tokens=16)  # the audio prompt needs several steps
    inputs = _inputs(hf, _audio(7, 2.0))
    assert inputs["input_ids"].shape[1] > 40
    _add_audio(engine, "chunked", inputs)
    assert _run(engine)["chunked"].outputs[0].token_ids == _reference(hf, inputs)


def test_prefix_cache_never_shares_blocks_across_different_audio(model_dir: Path, hf) -> None:
    engine = _engine(model_dir)
    first, other = _inputs(hf, _audio(20, 1.5)), _inputs(hf, _audio(21, 1.5))
    assert torch.equal(first["input_ids"], other["input_ids"])  # same text, same placeholder count
    _add_audio(engine, "first", first)
    _run(engine)
    _add_audio(engine, "other", other)
    _add_audio(engine, "same", first)
    _run_outputs = _run(engine)
    assert _run_outputs["other"].num_cached_tokens == 0
    assert _run_outputs["other"].outputs[0].token_ids == _reference(hf, other)
    assert _run_outputs["same"].num_cached_tokens > 0  # the same audio does reuse its prefix
    assert _run_outputs["same"].outputs[0].token_ids == _reference(hf, first)


def test_placeholder_count_must_match_the_audio(model_dir: Path, hf) -> None:
    engine = _engine(model_dir)
    inputs = _inputs(hf, _audio(30, 1.0))
    ids = inputs["input_ids"][0].tolist()
    audio_id = engine.capabilities.audio.placeholder_id
    one_short = ids.copy()
    one_short.remove(audio_id)
    with pytest.raises(ValueError, match="24 audio placeholders in the prompt, 25 audio embeddings"):
        engine.add_request("short", one_short, _greedy(), audio=_features(inputs))
    with pytest.raises(ValueError, match="0 audio placeholders"):
        engine.add_request("none", [i for i in ids if i != audio_id], _greedy(), audio=_features(inputs))
    assert not engine.has_unfinished_requests()


def test_an_encoder_fault_fails_its_request_alone(model_dir: Path, hf) -> None:
    engine = _engine(model_dir)
    good, bad = _inputs(hf, _audio(50, 1.0)), _inputs(hf, _audio(51, 1.0))
    processor, model = hf
    _add_audio(engine, "good", good)
    engine.add_request("bad", bad["input_ids"][0].tolist(), _greedy(), audio=_unencodable(bad))
    text_ids = processor.tokenizer("def main():").input_ids
    engine.add_request("text", text_ids, _greedy())
    finals = _run(engine)
    assert finals["bad"].error.startswith("internal error: RuntimeError: ")
    assert finals["bad"].outputs[0].token_ids == [] and finals["bad"].outputs[0].finish_reason == "abort"
    assert finals["good"].error is None and finals["good"].outputs[0].token_ids == _reference(hf, good)
    expected = model.generate(input_ids=torch.tensor([text_ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    assert finals["text"].outputs[0].token_ids == expected[0, len(text_ids) :].tolist()
    _add_audio(engine, "after", bad)  # the engine goes on serving audio
    assert _run(engine)["after"].outputs[0].token_ids == _reference(hf, bad)


def test_the_engine_thread_encodes_and_contains_a_fault(model_dir: Path, hf) -> None:
    """Through AsyncEngine, as the server sends it: the failing request gets the crash handler's words
    (a 500, as when the server encoded the audio itself), a concurrent one its tokens, and the engine
    stays ready."""
    good, bad = _inputs(hf, _audio(60, 0.8)), _inputs(hf, _audio(61, 0.8))
    runner = AsyncEngine(lambda: _engine(model_dir))
    runner.start()
    assert runner.ready_event.wait(120) and runner.ready

    async def final(request_id: str, inputs: dict, audio: AudioFeatures) -> RequestOutput:
        outputs = runner.generate(request_id, inputs["input_ids"][0].tolist(), _greedy(), audio=audio)
        return [o async for batch in outputs for o in batch][-1]

    async def both() -> list:
        return await asyncio.gather(
            final("good", good, _features(good)), final("bad", bad, _unencodable(bad)), return_exceptions=True
        )

    try:
        ok, failed = asyncio.run(both())
        assert isinstance(failed, EngineRequestError) and not failed.bad_request
        assert str(failed).startswith("internal error: RuntimeError: ")
        assert ok.outputs[0].token_ids == _reference(hf, good)
        assert runner.ready
    finally:
        runner.shutdown()


def test_voxtral_batched_and_chunked_matches_generate(tmp_path_factory: pytest.TempPathFactory) -> None:
    from transformers import AutoFeatureExtractor, AutoTokenizer, VoxtralForConditionalGeneration

    from keepwarm_runtime.modelgen.voxtral import BEGIN_AUDIO, make_voxtral

    model_dir = make_voxtral(tmp_path_factory.mktemp("voxtral") / "tiny-voxtral")
    extractor, tokenizer = (
        AutoFeatureExtractor.from_pretrained(model_dir),
        AutoTokenizer.from_pretrained(model_dir),
    )
    reference = VoxtralForConditionalGeneration.from_pretrained(model_dir).eval()
    engine = _engine(model_dir, max_num_batched_tokens=160, num_kv_blocks=256)
    audio_id = engine.capabilities.audio.placeholder_id
    requests = {}
    for i, text in enumerate(["What is this?", "Transcribe it."]):
        features = extractor(_audio(40 + i, 1.0 + i), sampling_rate=16000, return_tensors="pt").input_features
        ids = [tokenizer.bos_token_id, tokenizer.convert_tokens_to_ids(BEGIN_AUDIO)] + [audio_id] * 375
        ids += tokenizer(text, add_special_tokens=False).input_ids
        engine.add_request(f"v{i}", ids, _greedy(), audio=audio_features([AudioClip(features)]))
        requests[f"v{i}"] = (ids, features)
    text_ids = tokenizer("class Foo:").input_ids
    engine.add_request("text", text_ids, _greedy())
    finals = _run(engine)
    for request_id, (ids, features) in requests.items():
        out = reference.generate(
            input_ids=torch.tensor([ids]), input_features=features, max_new_tokens=MAX_TOKENS, do_sample=False
        )
        assert finals[request_id].outputs[0].token_ids == out[0, len(ids) :].tolist()
    out = reference.generate(input_ids=torch.tensor([text_ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    assert finals["text"].outputs[0].token_ids == out[0, len(text_ids) :].tolist()
