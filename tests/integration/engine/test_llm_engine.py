"""LLMEngine behaviour on a real tiny checkpoint: stops, n, logprobs, abort, preemption, prefix cache,
chat, weights from the node cache giving the same tokens as weights from disk, and packed bfloat16
weights giving the same tokens and logprobs as unpacked ones, through a sleep and a wake, and the AMX
and AVX-512 BF16 linear kernels within their tolerance of oneDNN."""

from __future__ import annotations

import dataclasses
import itertools
import json
import threading
from pathlib import Path

import pytest
import torch

from keepwarm_runtime import LLM, SamplingParams
from keepwarm_runtime.engine.auto_dtype import cpu_vendor
from keepwarm_runtime.engine.config import EngineConfig
from keepwarm_runtime.engine.cpu_linear import (
    PackedLinear,
    amx_unavailable,
    bf16_kernel_max_rows,
    bf16_unavailable,
    f32_unavailable,
    packed_weights_supported,
)
from keepwarm_runtime.engine.llm_engine import LLMEngine
from keepwarm_runtime.engine.sampling_params import RequestOutputKind

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(make_tiny):
    return make_tiny("llama")


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model_dir, block_size=4, num_kv_blocks=128)


def prompts(n: int, length: int = 20, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [
        {"prompt_token_ids": torch.randint(10, 2000, (length + i,), generator=g).tolist()} for i in range(n)
    ]


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_same_tokens_and_close_logprobs(got, want, tolerance: float) -> None:
    """The same greedy tokens, and each logprob `want` reports within `tolerance` nats in `got`; of the
    top ones, only a near tie (within `tolerance`) at the last rank reported may swap which token is
    reported."""
    assert tokens(got) == tokens(want)
    for g, w in zip(got, want, strict=True):
        for g_step, w_step in zip(g.outputs[0].logprobs, w.outputs[0].logprobs, strict=True):
            got_last = min(logprob.logprob for logprob in g_step.values())
            for token, logprob in w_step.items():
                if token in g_step:
                    assert abs(g_step[token].logprob - logprob.logprob) <= tolerance
                else:  # ranked below `got`'s last reported token: it was a tie with it, within the tolerance
                    assert logprob.logprob - got_last <= tolerance and len(g_step) == len(w_step)


def test_weights_from_the_cache_match_weights_from_disk(model_dir, llm, tmp_path) -> None:
    from keepwarm_runtime.cache.daemon import CacheDaemon, DaemonConfig

    daemon = CacheDaemon(DaemonConfig(socket_dir=tmp_path / "sock", tier="host", dtype="float32"))
    daemon.add_model(model_dir)
    daemon.bind()
    server = threading.Thread(target=daemon.serve_forever, daemon=True)
    server.start()
    try:
        cached = LLM(
            model_dir,
            block_size=4,
            num_kv_blocks=128,
            cache_socket_dir=str(tmp_path / "sock"),
            cache_fallback=False,
        )
        assert cached.engine.load_info.source == "cache" and llm.engine.load_info.source == "disk"
        batch = prompts(6)
        assert tokens(cached.generate(batch, GREEDY)) == tokens(llm.generate(batch, GREEDY))
    finally:
        daemon.stop()
        server.join(timeout=10)  # serve_forever closes the daemon on its way out


def test_stop_token_string_and_length(llm) -> None:
    prompt = prompts(1)
    free = llm.generate(prompt, GREEDY)[0].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    stop_id = free.token_ids[3]
    by_id = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id]))
    first = free.token_ids.index(stop_id)
    assert by_id[0].outputs[0].token_ids == free.token_ids[: first + 1]
    assert (by_id[0].outputs[0].finish_reason, by_id[0].outputs[0].stop_reason) == ("stop", stop_id)
    stop_text = free.text[len(free.text) // 2 :][:3]
    by_text = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop=[stop_text]))[0].outputs[
        0
    ]
    assert by_text.finish_reason == "stop" and by_text.stop_reason == stop_text
    assert by_text.text == free.text[: free.text.index(stop_text)]


def test_n_seeded_samples_and_logprobs(llm) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6, logprobs=2, ignore_eos=True)
    first = llm.generate(prompts(1), params)[0]
    again = llm.generate(prompts(1), params)[0]
    assert [o.index for o in first.outputs] == [0, 1, 2]
    assert tokens([first]) == tokens([again])
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1
    out = first.outputs[0]
    assert len(out.logprobs) == 6 and all(t in lp for t, lp in zip(out.token_ids, out.logprobs, strict=True))
    assert out.cumulative_logprob == pytest.approx(
        sum(lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs, strict=True))
    )


def test_plain_greedy_batches_give_the_outputs_of_the_full_sampler(model_dir, llm) -> None:
    """A batch of plain greedy rows takes the sampler's argmax alone (Sampler.greedy_tokens) and the
    outputs are built as each row is appended: every step's outputs (order, text, tokens, logprobs,
    reasons) are those of the full sampler's path, through stops, n=2 and a logprobs request joining."""
    batch = [p["prompt_token_ids"] for p in prompts(4, length=9, seed=3)]
    free = llm.generate([{"prompt_token_ids": batch[0]}], GREEDY)[0].outputs[0]
    requests = [
        SamplingParams(temperature=0, max_tokens=10),
        SamplingParams(n=2, temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, stop=[free.text[4:7]], ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[free.token_ids[5]], ignore_eos=True),
    ]

    def run(fast: bool) -> tuple[list[list[tuple]], int]:
        engine = LLM(model_dir, block_size=4, num_kv_blocks=128).engine
        greedy_tokens, taken = engine.sampler.greedy_tokens, []
        if fast:  # count the batches that took it
            engine.sampler.greedy_tokens = lambda s, x: taken.append(1) or greedy_tokens(s, x)
        else:  # every batch: the full sampler
            engine.sampler.greedy_tokens = lambda s, x: None
        for i, params in enumerate(requests):  # the stops are in batch[0]'s free output
            engine.add_request(f"plain-{i}", batch[0 if i > 1 else i], params)
        steps = []
        while engine.has_unfinished_requests():
            if len(steps) == 3:
                engine.add_request("lp", batch[1], SamplingParams(temperature=0, max_tokens=4, logprobs=1))
            steps.append([_seen(o) for o in engine.step()])
        return steps, len(taken)

    (fast, taken), (full, _) = run(fast=True), run(fast=False)
    assert fast == full and taken
    finished = [c for step in fast for o in step for c in o[4] if c[5] is not None]
    assert {c[5] for c in finished} == {"stop", "length"}  # the stops were reached
    assert any(len(o[4]) == 2 for step in fast for o in step)


def test_final_only_requests_get_one_output_the_last_a_cumulative_request_gets(model_dir, llm) -> None:
    """RequestOutputKind.FINAL_ONLY: one output per request, when it finishes, equal to the last output of
    the same request asked CUMULATIVE (text byte for byte, tokens, logprobs, reasons), through stop
    strings (read at every step), include_stop_str_in_output, stop ids, n=2 and logprobs; a request
    without stop strings has its text detokenised only once it finishes."""
    batch = [p["prompt_token_ids"] for p in prompts(3, length=9, seed=5)]
    free = llm.generate([{"prompt_token_ids": batch[0]}], GREEDY)[0].outputs[0]
    stop = free.text[4:7]
    requests = [
        (batch[1], dict(temperature=0, max_tokens=10)),
        (batch[2], dict(n=2, temperature=0.8, seed=3, max_tokens=7, ignore_eos=True, logprobs=2)),
        (batch[0], dict(temperature=0, max_tokens=12, stop=[stop], ignore_eos=True)),
        (batch[0], dict(temperature=0, max_tokens=12, stop=[stop], include_stop_str_in_output=True)),
        (batch[0], dict(temperature=0, max_tokens=12, stop_token_ids=[free.token_ids[5]], ignore_eos=True)),
    ]

    def run(kind: RequestOutputKind) -> tuple[dict[str, list[tuple]], list[int]]:
        engine = LLM(model_dir, block_size=4, num_kv_blocks=128).engine  # no prefix hits from the other run
        for i, (ids, fields) in enumerate(requests):
            engine.add_request(f"{kind.value}-{i}", ids, SamplingParams(**fields, output_kind=kind))
        seen: dict[str, list[tuple]] = {}
        stepped: list[int] = []  # tokens detokenised so far by unfinished requests without stop strings
        while engine.has_unfinished_requests():
            for output in engine.step():
                seen.setdefault(output.request_id.split("-")[1], []).append(_seen(output)[1:])
                assert output.first_token_time is not None
            stepped += [
                detok.fed
                for r in engine.requests.values()
                if not r.seqs[0].params.stop
                for detok in r.detokenizers
            ]
        return seen, stepped

    (cumulative, detokenised), (final, deferred) = (
        run(RequestOutputKind.CUMULATIVE),
        run(RequestOutputKind.FINAL_ONLY),
    )
    assert {i: outputs[-1] for i, outputs in cumulative.items()} == {i: o[-1] for i, o in final.items()}
    assert all(len(outputs) == 1 and outputs[0][0] for outputs in final.values())
    assert max(detokenised) > 0 and set(deferred) == {0}
    texts = {i: outputs[-1][3][0][1] for i, outputs in cumulative.items()}
    assert texts["2"] == free.text[: free.text.index(stop)] and texts["3"].endswith(stop)


def test_delta_outputs_put_together_are_the_cumulative_outputs_and_never_show_half_a_stop(model_dir) -> None:
    """RequestOutputKind.DELTA: each output holds what its step added (text, tokens, logprobs; the
    prompt's logprobs on the first alone) and, put together, they are the CUMULATIVE outputs step by
    step, through stop strings, include_stop_str_in_output, stop ids, n=2, logprobs and a scoring-only
    request. A stop string that starts in one step's text and ends in the next is never half shown:
    every output of either kind is a prefix of the request's last text."""
    ids = prompts(1, length=9, seed=5)[0]["prompt_token_ids"]
    free = _texts_by_step(LLM(model_dir, block_size=4, num_kv_blocks=128).engine, ids)
    whole = free[-1]
    # Two characters that first occur across a step boundary: the last of one step's text, the first
    # of the next one's.
    stop = next(
        whole[len(a) - 1 : len(a) + 1]
        for a, b in itertools.pairwise(free)
        if a and len(b) > len(a) and whole.find(whole[len(a) - 1 : len(a) + 1]) == len(a) - 1
    )
    requests = [
        dict(temperature=0, max_tokens=12, stop=[stop], ignore_eos=True),
        dict(temperature=0, max_tokens=12, stop=[stop, "not in it"], include_stop_str_in_output=True),
        dict(n=2, temperature=0.8, seed=3, max_tokens=7, ignore_eos=True, logprobs=2, prompt_logprobs=1),
        dict(temperature=0, max_tokens=9, stop=["zzz-no-such-text"], ignore_eos=True),
        dict(temperature=0, max_tokens=0, prompt_logprobs=2),
    ]

    def run(kind: RequestOutputKind) -> dict[str, list]:
        engine = LLM(model_dir, block_size=4, num_kv_blocks=128).engine
        for i, fields in enumerate(requests):
            engine.add_request(f"{kind.value}-{i}", ids, SamplingParams(**fields, output_kind=kind))
        seen: dict[str, list] = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                seen.setdefault(output.request_id.split("-")[1], []).append(output)
        return seen

    cumulative, deltas = run(RequestOutputKind.CUMULATIVE), run(RequestOutputKind.DELTA)
    assert cumulative["0"][-1].outputs[0].text == whole[: whole.index(stop)]
    for i, outputs in cumulative.items():
        assert [_seen(o)[1:] for o in _put_together(deltas[i])] == [_seen(o)[1:] for o in outputs]
        for o in outputs:  # never more of the text than the request ends with
            assert all(outputs[-1].outputs[c.index].text.startswith(c.text) for c in o.outputs)
        assert [o.prompt_logprobs is None for o in deltas[i]][1:] == [True] * (len(deltas[i]) - 1)
        assert deltas[i][0].prompt_logprobs == outputs[0].prompt_logprobs
    assert max(len(d.outputs[0].token_ids) for d in deltas["3"]) == 1  # one token a step, not all so far


def _texts_by_step(engine: LLMEngine, ids: list[int]) -> list[str]:
    engine.add_request("free", ids, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    texts: list[str] = []
    while engine.has_unfinished_requests():
        texts += [o.outputs[0].text for o in engine.step()]
    return texts


def _put_together(deltas: list) -> list:
    """Each DELTA output as the cumulative one it stands for: everything up to it joined."""
    joined, so_far = [], {}
    for d in deltas:
        completions = []
        for c in d.outputs:
            before = so_far.get(c.index)
            if before is not None:
                c = dataclasses.replace(
                    c,
                    text=before.text + c.text,
                    token_ids=before.token_ids + c.token_ids,
                    logprobs=None if c.logprobs is None else before.logprobs + c.logprobs,
                )
            so_far[c.index] = c
            completions.append(c)
        joined.append(dataclasses.replace(d, outputs=completions))
    return joined


def _seen(output) -> tuple:
    """What a client reads of one step's output."""
    completions = [
        (c.index, c.text, list(c.token_ids), c.cumulative_logprob, c.logprobs, c.finish_reason, c.stop_reason)
        for c in output.outputs
    ]
    return (output.request_id, output.finished, output.error, output.num_cached_tokens, completions)


def test_warm_up_leaves_nothing_behind(model_dir) -> None:
    """A warmed engine holds no request, no KV block and no cached prefix, and answers as an unwarmed
    one does (greedy: the sampler's random stream is untouched either way). The GPU's warm-up request
    runs here on CPU, where warm_up() itself runs none (the KV probe was its pass)."""
    cold = LLM(model_dir, block_size=4, num_kv_blocks=128)
    warm = LLM(model_dir, block_size=4, num_kv_blocks=128)
    warm.engine.run_warm_up_request()
    assert not warm.engine.has_unfinished_requests() and warm.engine.stats().kv_cache_usage == 0
    assert warm.engine.block_manager.cached == {}
    batch = prompts(3)
    assert tokens(warm.generate(batch, GREEDY)) == tokens(cold.generate(batch, GREEDY))


def test_abort_frees_blocks_at_once(llm) -> None:
    engine = llm.engine
    engine.add_request("x", prompts(1, length=30)[0]["prompt_token_ids"], GREEDY)
    engine.step()
    assert engine.stats().kv_cache_usage > 0
    engine.abort_request("x")
    engine.abort_request("unknown")
    assert engine.stats().kv_cache_usage == 0 and not engine.has_unfinished_requests()


def test_preemption_and_chunked_prefill_do_not_change_greedy_output(model_dir, llm) -> None:
    batch = prompts(8, length=12)
    expected = tokens(llm.generate(batch, GREEDY))
    tight = LLM(
        model_dir, block_size=4, num_kv_blocks=24, max_num_batched_tokens=16, enable_prefix_caching=False
    )
    assert tokens(tight.generate(batch, GREEDY)) == expected
    assert tight.engine.stats().num_preemptions > 0


def test_prefix_cache_hits_give_the_same_tokens(llm) -> None:
    shared = prompts(1, length=40, seed=5)[0]["prompt_token_ids"]
    batch = [{"prompt_token_ids": [*shared, 7 + i]} for i in range(3)]
    first = llm.generate(batch[:1], GREEDY)
    rest = llm.generate(batch, GREEDY)
    assert rest[0].num_cached_tokens >= 36
    assert tokens(rest[:1]) == tokens(first)


def test_chat_renders_one_bos(llm) -> None:
    out = llm.chat([{"role": "user", "content": "Hello!"}], SamplingParams(max_tokens=4))[0]
    bos = llm.get_tokenizer().bos_token_id
    assert out.prompt_token_ids.count(bos) == 1 and out.prompt_token_ids[0] == bos
    assert len(out.outputs[0].token_ids) <= 4 and isinstance(out.outputs[0].text, str)
    text_out = llm.generate("Hello", SamplingParams(max_tokens=2))[0]
    assert text_out.prompt_token_ids[0] == bos and text_out.prompt == "Hello"


def test_bad_requests_are_rejected_clearly(model_dir) -> None:
    engine = LLMEngine(EngineConfig(model_dir, num_kv_blocks=8, block_size=4))
    assert engine.max_model_len == 32
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("a", list(range(40)), SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("b", [], SamplingParams())
    with pytest.raises(ValueError, match="token ids must be in"):
        engine.add_request("c", [10**9], SamplingParams())


# Per architecture, what each layer fuses (engine/cpu_fused.py), and the model's last norm: Qwen3's,
# Gemma 3's and OLMoE's query and key norms, Gemma 2's and 3's four around the MLP, DeepSeek-V3's
# latent norms; MoE blocks are not MLPs (engine/moe runs them), Qwen2-MoE's shared expert and
# DeepSeek-V3's dense and shared MLPs are; Phi-3's and GLM's MLPs are one gate-and-up product, Gemma's
# GELU-tanh; Gemma's layer is Llama's with Gemma's norm (its own fused add), Gemma 2's and 3's a
# sandwich of norms around each sublayer.
LLAMA_LAYER = {"rms_norm": 2, "mlp": 1, "attention": 1, "decoder_layer": 1}
PHI3_PARTIAL = "phi3-partial-rotary"  # Phi-3 rotating half of each head's dims, as Phi-4-mini does 3/4
FUSED_ARCHS = {
    "llama": LLAMA_LAYER,
    "mistral": LLAMA_LAYER,
    "ministral": LLAMA_LAYER,
    "ministral3": LLAMA_LAYER,
    "qwen2": LLAMA_LAYER,
    "qwen2_moe": LLAMA_LAYER,
    "qwen3": LLAMA_LAYER | {"rms_norm": 4},
    "qwen3_moe": {"rms_norm": 4, "attention": 1, "decoder_layer": 1},
    "smollm3": LLAMA_LAYER,
    "olmoe": {"rms_norm": 4, "attention": 1, "decoder_layer": 1},
    "mixtral": {"rms_norm": 2, "attention": 1},
    "granite": {"rms_norm": 2, "mlp": 1, "attention": 1},
    "phi3": {"rms_norm": 2, "gate_up_mlp": 1, "partial_rotary_attention": 1},
    PHI3_PARTIAL: {"rms_norm": 2, "gate_up_mlp": 1, "partial_rotary_attention": 1},  # half of each head
    "glm": {"rms_norm": 2, "gate_up_mlp": 1, "pairs_rotary_attention": 1, "decoder_layer": 1},
    "glm4": {
        "rms_norm": 4,
        "gate_up_mlp": 1,
        "pairs_rotary_attention": 1,
    },  # two more norms, after the attention and the MLP
    "deepseek_v3": {"rms_norm": 4, "mlp": 1, "attention": 1, "decoder_layer": 1},
    "gemma": {"gemma_rms_norm": 2, "gelu_tanh_mlp": 1, "attention": 1, "gemma_decoder_layer": 1},
    "gemma2": {"gemma_rms_norm": 4, "gelu_tanh_mlp": 1, "attention": 1, "sandwich_layer": 1},
    "gemma3": {"gemma_rms_norm": 6, "gelu_tanh_mlp": 1, "attention": 1, "sandwich_layer": 1},
    "starcoder2": {"attention": 1},  # LayerNorms and a GELU MLP: only its rotary is Llama's
    "gpt_neox": {"partial_rotary_attention": 1},  # a quarter of each head, GLM-4.5's code
    "glm4_moe": {
        "rms_norm": 2,
        "mlp": 1,
        "partial_rotary_attention": 1,
        "decoder_layer": 1,
    },  # dense or shared
    "exaone4": {"rms_norm": 4, "mlp": 1, "attention": 1},
}


@pytest.fixture(scope="module")
def make_fusable(make_tiny, tmp_path_factory):
    """``make_tiny``'s model where `keepwarm make-model` has the architecture, else the conformance
    sweep's shrink of transformers' own config (tests/sweep/shrink.py), in float32."""
    from keepwarm_runtime.modelgen.architectures import ARCHITECTURES
    from tests.sweep.judge import build_checkpoint

    shrunk: dict[str, Path] = {}  # one float32 checkpoint an architecture serves both dtypes

    def make(arch: str, dtype: str) -> Path:
        if arch in ARCHITECTURES:
            return make_tiny(arch, dtype)
        if arch not in shrunk:
            shrunk[arch] = tmp_path_factory.mktemp(f"shrunk-{arch}")
            build_checkpoint(arch.split("-")[0], shrunk[arch], make_tiny("llama"))
            if arch == PHI3_PARTIAL:
                config_path = shrunk[arch] / "config.json"
                config = json.loads(config_path.read_text())
                config["rope_parameters"]["partial_rotary_factor"] = 0.5
                config_path.write_text(json.dumps(config))
        return shrunk[arch]

    return make


# The kernels each fused kind calls (a SiLU MLP's products and activation are one AMX operator where
# the CPU has AMX): a module counted as fused whose kernel is never called would be falling back.
KIND_KERNELS = {
    "rms_norm": {"rms_norm"},
    "gemma_rms_norm": {"gemma_rms_norm"},
    "mlp": {"silu_and_mul", "amx_gate_up_silu"},
    "gelu_tanh_mlp": {"gelu_tanh_and_mul"},
    "gate_up_mlp": {"silu_and_mul_halves"},
    "attention": {"rotary_embedding", "rotary_embedding_interleave"},
    "partial_rotary_attention": {"rotary_embedding"},
    "pairs_rotary_attention": {"rotary_embedding_pairs"},
    "decoder_layer": {"add_rms_norm"},
    "gemma_decoder_layer": {"add_gemma_rms_norm"},
    "sandwich_layer": {"gemma_norm_add_norm", "gemma_norm_add"},
}
# Fused kinds whose forward never reaches the kernel here: none (DeepSeek-V3's attention calls its
# interleaved rotary, on in DeepSeek's configs and the sweep's shrink, and takes its kernel).
NOT_REACHED: dict[str, set[str]] = {}


@pytest.mark.parametrize(("dtype", "tolerance"), [("bfloat16", 0.05), ("float32", 1e-4)])
@pytest.mark.parametrize("arch", sorted(FUSED_ARCHS))
def test_fused_cpu_kernels_give_tokens_and_logprobs_within_their_tolerance(
    make_fusable, arch, dtype, tolerance, monkeypatch
):
    """Fused RMSNorm, activation-and-mul and rotary (engine/cpu_fused.py) against the same engine
    without them: the kernels round where the modules do, so a logprob may move by what one bfloat16
    ulp in an activation moves it (stated tolerance 0.05 nats; at this size none moved), or in float32
    a few float32 ulps (1e-4 nats), and greedy tokens are the same. Prefill and decode steps of several
    rows and one row; every fused kind's kernel runs."""
    from keepwarm_runtime.engine.attention import native

    model_dir = make_fusable(arch, dtype)
    kwargs = {"dtype": dtype, "block_size": 4, "num_kv_blocks": 256}
    plain = LLM(model_dir, cpu_fused_ops=False, **kwargs)
    fused = LLM(model_dir, **kwargs)
    assert plain.engine.fused_ops.total == 0
    layers = fused.engine.model.config.get_text_config().num_hidden_layers
    want_counts = {kind: n * layers + kind.endswith("rms_norm") for kind, n in FUSED_ARCHS[arch].items()}
    assert fused.engine.fused_ops.counts == want_counts

    params = SamplingParams(temperature=0, max_tokens=10, logprobs=3, ignore_eos=True)
    batch = prompts(6, length=9, seed=5)
    want = plain.generate(batch, params)
    called: set[str] = set()
    real = native.op
    monkeypatch.setattr(native, "op", lambda name: called.add(name) or real(name))
    got = fused.generate(batch, params)
    assert_same_tokens_and_close_logprobs(got, want, tolerance=tolerance)
    idle = [kind for kind in want_counts if not KIND_KERNELS[kind] & called]
    assert idle == sorted(NOT_REACHED.get(arch, ())), called


@pytest.mark.skipif(not packed_weights_supported(), reason="oneDNN has no native bfloat16 here")
def test_packed_bfloat16_weights_give_the_tokens_and_logprobs_of_unpacked_ones(make_tiny) -> None:
    from keepwarm_runtime.engine.sleep import sleep, wake

    model_dir = make_tiny("llama", "bfloat16")
    # the AMX and AVX-512 BF16 kernels off on both sides: they round otherwise (their own tests below)
    off = {"cpu_amx_linear": False, "cpu_bf16_linear": False}
    kwargs = {"dtype": "bfloat16", "block_size": 4, "num_kv_blocks": 256, **off}
    plain = LLM(model_dir, cpu_packed_weights=False, **kwargs)
    packed = LLM(model_dir, **kwargs)
    assert not plain.engine.linear_packer.layers
    packer = packed.engine.linear_packer
    packer.thread.join(timeout=120)
    assert packer.layers and all(layer._packed is not None for layer in packer.layers)
    assert not any(isinstance(m, PackedLinear) for m in plain.engine.model.modules())

    params = SamplingParams(temperature=0, max_tokens=10, logprobs=3, ignore_eos=True)
    batch = prompts(6, length=9, seed=3)  # prefill and decode steps of several rows, and single rows
    want = plain.generate(batch, params)
    got = packed.generate(batch, params)
    assert tokens(got) == tokens(want)
    assert [o.outputs[0].logprobs for o in got] == [o.outputs[0].logprobs for o in want]

    report = sleep(packed.engine, level=2)  # weights read from disk: level 2 lets them go
    assert report.weights_released and all(layer._packed is None for layer in packer.layers)
    wake(packed.engine, report.weights_released)
    packer.thread.join(timeout=120)
    assert all(layer._packed is not None for layer in packer.layers)
    assert tokens(packed.generate(batch, params)) == tokens(want)


@pytest.mark.skipif(amx_unavailable() is not None, reason="the AMX kernel cannot run here")
def test_amx_linear_layers_give_bfloat16_tokens_and_logprobs_within_their_tolerance(make_tiny) -> None:
    """Steps of up to 64 tokens on the AMX kernel (engine/cpu_linear.py) against the same engine on
    oneDNN: an output may move by one bfloat16 ulp (the sums' order), so a logprob may move by what that
    moves it (stated tolerance 0.05 nats, as for the fused kernels) and greedy tokens are the same, with
    and without packed weights for the larger steps; --no-cpu-amx-linear leaves every layer on oneDNN."""
    model_dir = make_tiny("llama", "bfloat16")
    kwargs = {"dtype": "bfloat16", "block_size": 4, "num_kv_blocks": 256}
    onednn = LLM(model_dir, cpu_amx_linear=False, cpu_bf16_linear=False, **kwargs)
    assert onednn.engine.amx_linear_layers == onednn.engine.bf16_linear_layers == 0
    layers = onednn.engine.model.config.num_hidden_layers
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=3, ignore_eos=True)
    batch = prompts(6, length=9, seed=7)  # prefill and decode steps of several rows, and single rows
    want = onednn.generate(batch, params)
    for packed in (True, False):
        amx = LLM(model_dir, cpu_packed_weights=packed, **kwargs)
        assert amx.engine.amx_linear_layers == 7 * layers + 1  # every projection and the LM head
        assert amx.engine.bf16_linear_layers == 0  # with AMX tiles, the AVX-512 BF16 kernel takes none
        assert bool(amx.engine.linear_packer.layers) is packed
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as ran:
            got = amx.generate(batch, params)
        assert_same_tokens_and_close_logprobs(got, want, tolerance=0.05)
        ops = {event.key: event.count for event in ran.key_averages()}
        assert ops.get("keepwarm_cpu::amx_gate_up_silu", 0) >= layers  # the MLPs' gate and up as one


@pytest.mark.parametrize(
    ("dtype", "switch", "layers_on_it", "op", "tolerance"),
    [
        # float32: the sums run in another order than MKL's, so outputs move by float32 rounding and a
        # logprob by what that moves it (stated tolerance 1e-4 nats, as for tensor-parallel ranks;
        # 3.3e-6 measured)
        pytest.param(
            "float32", "cpu_f32_linear", "f32_linear_layers", "f32_linear", 1e-4,
            marks=pytest.mark.skipif(
                f32_unavailable() is not None, reason="the float32 kernel cannot run here"
            ),
            id="float32",
        ),
        # bfloat16 without AMX: an output may move by one bfloat16 ulp, a logprob by what that moves it
        # (stated tolerance 0.05 nats, as for the AMX kernel)
        pytest.param(
            "bfloat16", "cpu_bf16_linear", "bf16_linear_layers", "bf16_linear", 0.05,
            marks=pytest.mark.skipif(
                amx_unavailable() is None or bf16_unavailable() is not None,
                reason="the AVX-512 BF16 kernel cannot run here, or AMX takes its layers",
            ),
            id="bfloat16",
        ),
    ],
)  # fmt: skip
def test_the_avx512_kernels_give_the_tokens_and_logprobs_of_torch_within_their_tolerance(
    make_tiny, dtype: str, switch: str, layers_on_it: str, op: str, tolerance: float
) -> None:
    """Steps of up to 128 tokens (float32), every step (bfloat16, no AMX; on a CPU whose dot products
    run at its FMAs' rate, steps of up to FAST_DOT_KERNEL_MAX_ROWS rows) on keepwarm's AVX-512 linear
    kernels (engine/cpu_linear.py) against the same engine with the kernel switched off
    (--no-cpu-f32-linear: MKL; --no-cpu-bf16-linear: oneDNN): the same greedy tokens, logprobs within
    the kernel's tolerance. Prefill and decode steps, several rows and one; every decode step's layers
    on the kernel (profiler count)."""
    model_dir = make_tiny("llama", dtype)
    kwargs = {"dtype": dtype, "block_size": 4, "num_kv_blocks": 256}
    torch_only = LLM(model_dir, **{switch: False}, **kwargs)
    assert getattr(torch_only.engine, layers_on_it) == 0
    kernel = LLM(model_dir, **kwargs)
    layers = kernel.engine.model.config.num_hidden_layers
    assert getattr(kernel.engine, layers_on_it) == 7 * layers + 1  # every projection and the LM head
    max_rows = bf16_kernel_max_rows(cpu_vendor()) if dtype == "bfloat16" else None
    if dtype == "bfloat16":  # packed for the steps the kernel leaves to oneDNN, where it leaves any
        assert bool(kernel.engine.linear_packer.layers) == (max_rows is not None)
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=3, ignore_eos=True)
    batch = prompts(min(6, max_rows or 6), length=9, seed=11)  # decode steps the kernel takes
    want = torch_only.generate(batch, params)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as ran:
        got = kernel.generate(batch, params)
    assert_same_tokens_and_close_logprobs(got, want, tolerance=tolerance)
    ops = {event.key: event.count for event in ran.key_averages()}
    assert ops.get(f"keepwarm_cpu::{op}", 0) >= 9 * (7 * layers + 1)  # the 9 decode steps, every layer
