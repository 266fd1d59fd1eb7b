"""A tiny random Qwen2-Audio through the paged engine, against transformers' generate() on the same audio."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from keepwarm_runtime import SamplingParams
from keepwarm_runtime.engine.config import EngineConfig
from keepwarm_runtime.engine.llm_engine import LLMEngine
from keepwarm_runtime.engine.multimodal import encode_audio
from keepwarm_runtime.modelgen.qwen2_audio import make_qwen2_audio

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


def _add_audio(engine: LLMEngine, request_id: str, inputs: dict) -> None:
    ids = inputs["input_ids"][0].tolist()
    mm = encode_audio(engine.model, ids, inputs["input_features"], inputs["feature_attention_mask"])
    engine.add_request(request_id, ids, _greedy(), multimodal=mm)


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
    audio_id = engine.model.config.audio_token_id
    one_short = ids.copy()
    one_short.remove(audio_id)
    features, mask = inputs["input_features"], inputs["feature_attention_mask"]
    with pytest.raises(ValueError, match="24 audio placeholders in the prompt, 25 audio embeddings"):
        encode_audio(engine.model, one_short, features, mask)
    with pytest.raises(ValueError, match="0 audio placeholders"):
        encode_audio(engine.model, [i for i in ids if i != audio_id], features, mask)


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
    audio_id = engine.model.config.audio_token_id
    requests = {}
    for i, text in enumerate(["What is this?", "Transcribe it."]):
        features = extractor(_audio(40 + i, 1.0 + i), sampling_rate=16000, return_tensors="pt").input_features
        ids = [tokenizer.bos_token_id, tokenizer.convert_tokens_to_ids(BEGIN_AUDIO)] + [audio_id] * 375
        ids += tokenizer(text, add_special_tokens=False).input_ids
        engine.add_request(f"v{i}", ids, _greedy(), multimodal=encode_audio(engine.model, ids, features))
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
