"""WhisperEngine against transformers' own generate(): batched, staggered, detected languages, aborts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from keepwarm_runtime.audio.whisper_engine import TranscriptionParams, WhisperEngine
from keepwarm_runtime.model_kind import ModelKind, detect_kind
from keepwarm_runtime.modelgen.whisper import make_whisper


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> WhisperEngine:
    return WhisperEngine(make_whisper(tmp_path_factory.mktemp("whisper") / "tiny-whisper"), max_num_seqs=3)


def _clip(seed: int, seconds: float) -> torch.Tensor:
    return torch.from_numpy(
        np.random.default_rng(seed).normal(0, 0.1, int(16000 * seconds)).astype(np.float32)
    )


def _reference(engine: WhisperEngine, features: torch.Tensor, params: TranscriptionParams) -> list[int]:
    out = engine.model.generate(features[None], language=params.language, task=params.task)[0].tolist()
    while out and out[-1] == engine.eos_token_id:
        out.pop()
    return out


def _run(engine: WhisperEngine, requests: dict[str, tuple[torch.Tensor, TranscriptionParams]], per_step: int):
    """Add ``per_step`` requests before each step (staggered arrivals); return the final outputs."""
    pending = list(requests.items())
    finals, most_running = {}, 0
    while pending or engine.has_unfinished_requests():
        for request_id, (features, params) in pending[:per_step]:
            engine.add_request(request_id, features, params)
        pending = pending[per_step:]
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        most_running = max(most_running, engine.stats().num_running)
    return finals, most_running


def test_batched_and_staggered_requests_match_generate(engine: WhisperEngine) -> None:
    params = [
        TranscriptionParams("transcribe", "en"),
        TranscriptionParams("transcribe", None),
        TranscriptionParams("translate", "fr"),
        TranscriptionParams("translate", None),
        TranscriptionParams("transcribe", "de"),
    ]
    requests = {f"r{i}": (engine.features(_clip(i, 0.5 + i)), p) for i, p in enumerate(params)}
    finals, most_running = _run(engine, requests, per_step=2)
    assert most_running == 3  # batched, up to max_num_seqs
    for request_id, (features, p) in requests.items():
        reference = _reference(engine, features, p)
        assert finals[request_id].outputs[0].token_ids == reference
        assert finals[request_id].outputs[0].text == engine.tokenizer.decode(
            reference, skip_special_tokens=True
        )
        if p.language is not None:
            assert finals[request_id].language == p.language
    assert not engine.has_unfinished_requests()


def test_abort_frees_the_row_and_leaves_the_others_intact(engine: WhisperEngine) -> None:
    clips = {f"a{i}": engine.features(_clip(10 + i, 1.0)) for i in range(3)}
    for request_id, features in clips.items():
        engine.add_request(request_id, features, TranscriptionParams(language="en"))
    engine.step()
    engine.abort_request("a1")
    assert engine.stats().num_running == 2
    finals = {}
    while engine.has_unfinished_requests():
        finals |= {o.request_id: o for o in engine.step() if o.finished}
    assert set(finals) == {"a0", "a2"}
    for request_id in ("a0", "a2"):
        reference = _reference(engine, clips[request_id], TranscriptionParams(language="en"))
        assert finals[request_id].outputs[0].token_ids == reference


def test_sampling_is_reproducible_with_a_seed(engine: WhisperEngine) -> None:
    features = engine.features(_clip(20, 1.0))
    runs = []
    for request_id in ("s0", "s1"):
        engine.add_request(request_id, features, TranscriptionParams(language="en", temperature=1.0, seed=7))
        while engine.has_unfinished_requests():
            done = [o for o in engine.step() if o.finished]
        runs.append(done[0].outputs[0].token_ids)
    assert runs[0] == runs[1]
    assert runs[0] != _reference(engine, features, TranscriptionParams(language="en"))


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (TranscriptionParams(task="summarize"), "unknown task"),
        (TranscriptionParams(language="xx"), "unsupported language 'xx'; this model knows: de, en, fr"),
        (TranscriptionParams(temperature=1.5), "temperature"),
    ],
)
def test_bad_params_are_refused_by_name(
    engine: WhisperEngine, params: TranscriptionParams, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", engine.features(_clip(0, 0.1)), params)
    assert not engine.has_unfinished_requests()


def test_the_checkpoint_is_detected_as_a_speech_model(engine: WhisperEngine) -> None:
    assert detect_kind(engine.model.name_or_path) is ModelKind.SPEECH


def test_end_of_text_stops_after_the_first_token_like_generate(engine: WhisperEngine) -> None:
    """With end-of-text made the likeliest token, begin_suppress_tokens still forces one real token."""

    def favour_eos(_module: torch.nn.Module, _inputs: tuple, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.clone()
        logits[..., engine.eos_token_id] += 100.0
        return logits

    hook = engine.model.proj_out.register_forward_hook(favour_eos)
    try:
        features = engine.features(_clip(30, 1.0))
        params = TranscriptionParams(language="en")
        engine.add_request("eos", features, params)
        finals = []
        while engine.has_unfinished_requests():
            finals += [o for o in engine.step() if o.finished]
        reference = _reference(engine, features, params)
    finally:
        hook.remove()
    assert len(reference) == 1
    assert finals[0].outputs[0].token_ids == reference
    assert finals[0].outputs[0].finish_reason == "stop"
