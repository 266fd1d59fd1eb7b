"""Overlapped steps' CPU twin (engine/overlap.py): the loop a GPU overlaps, run on a real engine with
``async_scheduling=True`` against the same engine one step at a time.

Each step is launched before the one before it lands: a decode reads its input token, sampled by a step
not yet landed, from that step's output rather than from the sequence, blocks enter the prefix cache
once their tokens are known, and a sequence that finishes is computed once more and dropped. Here the
pass runs where it is launched (a CPU), so the outputs must be exactly those of the engine that lands
every step at once: tokens, logprobs, finish reasons, cached-token counts and every streamed output.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from keepwarm_runtime import LLM, SamplingParams
from keepwarm_runtime.engine.sampling_params import RequestOutputKind
from keepwarm_runtime.engine.sleep import sleep, wake

BLOCK = 4


def prompts(n: int, length: int = 9, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 2000, (length + 3 * i,), generator=g).tolist() for i in range(n)]


@pytest.fixture(scope="module")
def model_dir(make_tiny):
    return make_tiny("llama")


def engines(model_dir, **kwargs) -> tuple[LLM, LLM]:
    """(one step at a time, overlapped): the same engine otherwise."""
    options = {"dtype": "float32", "block_size": BLOCK, "num_kv_blocks": 128} | kwargs
    return LLM(model_dir, async_scheduling=False, **options), LLM(model_dir, async_scheduling=True, **options)


def completions(llm: LLM, batch: list[list[int]], params) -> list[tuple]:
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params)
    return [
        (c.token_ids, c.logprobs, c.finish_reason, c.stop_reason, c.text, o.num_cached_tokens)
        for o in outs
        for c in o.outputs
    ]


def streamed(llm: LLM, batch: list[list[int]], params: list[SamplingParams]) -> dict[str, list[tuple]]:
    """Every output the engine hands back, per request, in order (a server's streams)."""
    engine = llm.engine
    for i, (ids, p) in enumerate(zip(batch, params, strict=True)):
        engine.add_request(f"r{i}", ids, p)
    seen: dict[str, list[tuple]] = {f"r{i}": [] for i in range(len(batch))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            c = out.outputs[0]
            seen[out.request_id].append(
                (tuple(c.token_ids), c.text, c.finish_reason, out.finished, out.error)
            )
    return seen


def test_steps_run_ahead_and_read_their_input_from_the_step_before(model_dir) -> None:
    """After a decode step returns, the next is already launched: its sequences hold a pending token,
    which the step after reads from the device (if it read the stand-in, the previous token, the
    greedy tokens would differ from the one-at-a-time engine's)."""
    one, ahead = engines(model_dir)
    assert not one.engine.async_scheduling and ahead.engine.async_scheduling
    params = SamplingParams(temperature=0, max_tokens=7, logprobs=2, ignore_eos=True)
    batch = prompts(5)
    assert completions(ahead, batch, params) == completions(one, batch, params)
    engine = ahead.engine
    engine.add_request("x", batch[0], params)
    engine.step()  # its prefill: sampled ahead
    assert engine._running is not None and engine.requests["x"].seqs[0].num_pending == 1
    assert engine.requests["x"].seqs[0].output_token_ids == []  # not landed yet
    engine.step()  # the first decode launched, the prefill's token landed
    seq = engine.requests["x"].seqs[0]
    assert len(seq.output_token_ids) == 1 and seq.num_pending == 1
    while engine.has_unfinished_requests():
        engine.step()
    engine.settle()


def test_finishing_at_different_steps_stop_tokens_and_stop_strings(model_dir) -> None:
    """Sequences leaving the batch one by one (lengths, a stop token id, a stop string, EOS): each
    finishing sequence is computed once more and dropped, the others' rows move, and every streamed
    output, cumulative or final-only, is what the one-at-a-time engine hands back."""
    one, ahead = engines(model_dir)
    batch = prompts(6, seed=3)
    free = completions(one, batch[:1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    stop_id, stop_text = free[0][4], one.get_tokenizer().decode(free[0][6:8])
    params = [
        SamplingParams(temperature=0, max_tokens=2 + 2 * i, ignore_eos=True, logprobs=1) for i in range(3)
    ]
    params += [
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id], ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, stop=[stop_text] if stop_text.strip() else None),
        SamplingParams(temperature=0, max_tokens=10, output_kind=RequestOutputKind.FINAL_ONLY),
    ]
    batch[3] = batch[4] = batch[0]  # the stop token and the stop string occur in their outputs
    want = streamed(one, batch, params)
    assert want["r3"][-1][2] == "stop"
    assert streamed(ahead, batch, params) == want
    assert ahead.engine.block_manager.num_free_blocks == ahead.engine.block_manager.num_blocks


def test_seeded_sampling_n_and_logprobs(model_dir) -> None:
    """Seeded draws (each sequence's own generator), n > 1 and logprobs, sampled by the full sampler
    ahead of landing: the same tokens and logprobs."""
    one, ahead = engines(model_dir)
    params = SamplingParams(
        temperature=0.9, top_p=0.9, seed=11, n=2, max_tokens=8, logprobs=3, ignore_eos=True
    )
    batch = prompts(4, seed=5)
    got = completions(ahead, batch, params)
    assert got == completions(one, batch, params)
    assert len(got) == 8 and len({tuple(c[0]) for c in got}) > 1


def test_requests_that_read_their_tokens_land_each_step_at_once(model_dir) -> None:
    """Penalties, min_tokens and bad words read a sequence's tokens when it is sampled, so a step
    holding one is landed before the next is launched; beside plain requests, every output is the same."""
    one, ahead = engines(model_dir)
    batch = prompts(4, seed=7)
    plain = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    params = [
        plain,
        SamplingParams(temperature=0, max_tokens=9, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=9, min_tokens=6),
        plain,
    ]
    assert streamed(ahead, batch, params) == streamed(one, batch, params)
    assert not ahead.engine.requests and ahead.engine._running is None  # no step left ahead


def test_prompt_logprobs_and_scoring_only_requests(model_dir) -> None:
    """A step scoring prompt positions, and a request with max_tokens 0, are landed at once."""
    one, ahead = engines(model_dir)
    batch = prompts(3, seed=9)
    params = [
        SamplingParams(temperature=0, max_tokens=5, prompt_logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=1),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    ]
    outs = {
        name: [
            (o.prompt_logprobs, [c.token_ids for c in o.outputs])
            for o in llm.generate([{"prompt_token_ids": p} for p in batch], params)
        ]
        for name, llm in (("one", one), ("ahead", ahead))
    }
    assert outs["ahead"] == outs["one"]


def test_preemption_and_chunked_prefill(model_dir) -> None:
    """Too few blocks for the batch: sequences are preempted while a step holding them runs ahead,
    get their token when it lands and are recomputed; chunked prefill beside decodes."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    one, ahead = engines(model_dir, num_kv_blocks=24, max_num_batched_tokens=16, enable_prefix_caching=False)
    batch = prompts(8, length=12, seed=2)
    assert completions(ahead, batch, params) == completions(one, batch, params)
    assert ahead.engine.stats().num_preemptions > 0


def test_blocks_filled_ahead_serve_prefix_hits_with_the_right_tokens(model_dir) -> None:
    """Blocks completed by a token still pending are registered once it lands: the same prompts again,
    and prompts extending the first outputs, hit the prefix cache exactly as on the one-at-a-time engine."""
    one, ahead = engines(model_dir)
    params = SamplingParams(temperature=0, max_tokens=2 * BLOCK + 1, ignore_eos=True)
    batch = prompts(3, length=2 * BLOCK - 1, seed=4)  # the first decode completes a block
    results = []
    for llm in (one, ahead):
        first = completions(llm, batch, params)
        extended = [p + list(c[0]) for p, c in zip(batch, first, strict=True)]
        results.append(first + completions(llm, batch, params) + completions(llm, extended, params))
    assert results[1] == results[0]
    assert max(c[5] for c in results[1]) >= 3 * BLOCK  # the extended prompts hit output blocks


def test_an_abort_while_its_step_runs_ahead_leaves_the_others_alone(model_dir) -> None:
    one, ahead = engines(model_dir)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    batch = prompts(3, seed=6)
    want = completions(one, batch[1:], params)
    engine = ahead.engine
    for i, ids in enumerate(batch):
        engine.add_request(f"a{i}", ids, dataclasses.replace(params))
    outputs, after_abort = {}, []
    for step in range(40):
        if step == 3:
            assert engine._running is not None and engine.requests["a0"].seqs[0].num_pending == 1
            engine.abort_request("a0")  # in the step running ahead: dropped when it lands
        for out in engine.step():
            outputs[out.request_id] = out
            if step >= 3 and out.request_id == "a0":
                after_abort.append(out)
        if not engine.has_unfinished_requests():
            break
    assert not after_abort and "a0" not in engine.requests
    got = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in (outputs["a1"], outputs["a2"])]
    assert got == [(c[0], c[2]) for c in want]
    engine.settle()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_row_whose_sampling_fails_fails_its_request_alone(model_dir) -> None:
    """A row the full sampler could not sample (here a top_k past any vocabulary, as if validation
    were bypassed) gives the next step token 0 to read; its request fails when the step lands, and the
    others' tokens are those of the one-at-a-time engine."""
    one, ahead = engines(model_dir)
    batch = prompts(3, seed=8)
    results = {}
    for name, llm in (("one", one), ("ahead", ahead)):
        params = [SamplingParams(temperature=0.8, seed=i, max_tokens=6, ignore_eos=True) for i in range(3)]
        engine = llm.engine
        for i, (ids, p) in enumerate(zip(batch, params, strict=True)):
            engine.add_request(f"s{i}", ids, p)
        params[1].top_k = 2**70  # after validation: its first draw fails
        final = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = (out.outputs[0].token_ids, out.error is not None)
        results[name] = final
    assert results["ahead"] == results["one"]
    assert results["one"]["s1"][1] and not results["one"]["s0"][1]


def test_sleep_lands_the_step_running_ahead(model_dir) -> None:
    """Sleep needs the cache: it lands a step left ahead (the outputs come with the next step)."""
    one, ahead = engines(model_dir)
    first = completions(one, prompts(1), SamplingParams(temperature=0, max_tokens=1))[0][0][0]
    engine = ahead.engine
    # a stop token no step can see coming: the step after it is launched before it lands
    engine.add_request("z", prompts(1)[0], SamplingParams(temperature=0, stop_token_ids=[first]))
    finished = [o for _ in range(2) for o in engine.step() if o.finished]
    assert finished and engine._running is not None  # the finished sequence's extra step
    sleep(engine, 1)
    assert engine._running is None
    wake(engine, weights_released=False)
    assert completions(ahead, prompts(2), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))


def test_the_decode_graphs_twin_runs_ahead_too(model_dir) -> None:
    """Decode steps through the graphs' padded static buffers (their CPU twin), launched ahead."""
    one, ahead = engines(model_dir, max_num_seqs=8)
    ahead.engine.use_decode_graphs(capture=False)
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=1, ignore_eos=True)
    batch = prompts(5, seed=12)
    got, want = completions(ahead, batch, params), completions(one, batch, params)
    assert [c[0] for c in got] == [c[0] for c in want]
    assert ahead.engine.runner.graphs.replays >= params.max_tokens - 1


def test_a_block_completed_by_a_landed_token_is_a_prefix_hit_before_the_next_schedule(model_dir) -> None:
    """A prompt of two blocks less one: its prefill samples the token that completes the second block,
    which is pending when the first decode's pass (computing that position) is launched. The block is
    registered as that token lands, so a request queued right then hits both blocks, as it would on
    the one-at-a-time engine, where the block is registered before the next schedule too."""
    _, ahead = engines(model_dir)
    engine = ahead.engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("a", prompts(1, length=2 * BLOCK - 1, seed=13)[0], params)
    engine.step()  # the prefill, its token pending
    engine.step()  # the first decode launched (the last position of block 2), the prefill's token landed
    seq = engine.requests["a"].seqs[0]
    assert seq.num_tokens == 2 * BLOCK and seq.num_pending == 1
    engine.add_request("b", [*seq.token_ids, 5], params)
    outputs = {}
    while engine.has_unfinished_requests():
        outputs |= {o.request_id: o for o in engine.step()}
    assert outputs["b"].num_cached_tokens == 2 * BLOCK


def test_a_sequence_whose_last_token_is_pending_is_not_scheduled_again(model_dir) -> None:
    """A token that brings a sequence to max_tokens ends it when it lands, so no pass follows it: the
    overlapped engine runs as many forward passes as the one-at-a-time engine (a prefill and
    max_tokens - 1 decodes) and leaves no step running."""
    passes = {}
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    for name, llm in zip(("one", "ahead"), engines(model_dir), strict=True):
        count = []
        hook = llm.engine.model.register_forward_hook(lambda *_, c=count: c.append(1))
        outs = completions(llm, prompts(3, length=8), params)
        hook.remove()
        passes[name] = (len(count), [c[0] for c in outs])
        assert llm.engine._running is None
    assert passes["ahead"] == passes["one"] and passes["one"][0] == 5
