"""Decode graphs' CPU twin (engine/decode_graphs.py): the padded, static-buffer decode steps a CUDA graph
replays, run eagerly on a real engine, against the same engine without them.

What a GPU adds (the capture, the replay, FlashInfer's CUDA-graph wrapper) runs in tests/gpu/graphs
through scripts/gpu-check; everything before it (buckets, padding rows on a reserved block, the rows
handed back, the page table FlashInfer would plan, the eager fallback) is exercised here.
"""

from __future__ import annotations

import logging

import pytest
import torch

from keepwarm_runtime import LLM, SamplingParams
from keepwarm_runtime.engine.attention.page_table import page_table
from keepwarm_runtime.engine.decode_graphs import GraphUnsupported, bucket, capture_sizes
from keepwarm_runtime.log_once import clear_once_cache

BLOCK = 4
PARAMS = SamplingParams(temperature=0, max_tokens=9, logprobs=2, ignore_eos=True)


def prompts(n: int) -> list[dict]:
    return [{"prompt_token_ids": [7 + (11 * i + 5 * j) % 1900 for j in range(3 + 2 * i)]} for i in range(n)]


def engine(model_dir, twin: bool) -> LLM:
    llm = LLM(model_dir, dtype="float32", block_size=BLOCK, num_kv_blocks=96, max_num_seqs=12)
    if twin:
        llm.engine.use_decode_graphs(capture=False)
    return llm


def outputs(llm: LLM, n: int) -> list[tuple[list[int], list]]:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts(n), PARAMS)]


def close(got, want, tol: float = 1e-4) -> None:
    """The same greedy tokens, and logprobs within float32 rounding: a padded step multiplies more
    rows, which may move a sum's rounding (the float32 linear kernel's routing is by row count)."""
    for (g_ids, g_lp), (w_ids, w_lp) in zip(got, want, strict=True):
        assert g_ids == w_ids
        for g_step, w_step in zip(g_lp, w_lp, strict=True):
            assert g_step.keys() == w_step.keys()
            for token, g in g_step.items():
                assert abs(g.logprob - w_step[token].logprob) <= tol


def out_of_memory_at(twin: LLM, bucket_size: int) -> None:
    """The twin's attention backend runs out of memory planning that bucket (a stand-in: no GPU here)."""
    backend = twin.engine.runner.backend()
    original = backend.graph_metadata

    def graph_metadata(meta, size):
        if size == bucket_size:
            raise torch.OutOfMemoryError("CUDA out of memory (stand-in: no GPU here)")
        return original(meta, size)

    backend.graph_metadata = graph_metadata


def test_buckets_are_a_ladder_up_to_the_batch_cap() -> None:
    assert capture_sizes(256) == (1, 2, 4, 8, *range(16, 257, 16))
    assert capture_sizes(12) == (1, 2, 4, 8, 12)
    assert capture_sizes(1) == (1,)
    assert capture_sizes(1000)[-1] == 256
    sizes = capture_sizes(64)
    assert [bucket(b, sizes) for b in (1, 3, 8, 9, 17, 64, 65)] == [1, 4, 8, 16, 32, 64, None]


@pytest.mark.parametrize("batch", [3, 5, 12])
def test_padded_decode_steps_give_the_eager_engines_tokens_and_logprobs(make_tiny, batch) -> None:
    """3 and 5 sequences pad to buckets of 4 and 8 (their padding rows write to the reserved block and
    attend to it alone), 12 fills its bucket; every decode step of the twin goes through the buckets."""
    model_dir = make_tiny("llama")
    want = outputs(engine(model_dir, twin=False), batch)
    twin = engine(model_dir, twin=True)
    graphs = twin.engine.runner.graphs
    got = outputs(twin, batch)
    close(got, want)
    assert graphs.replays >= PARAMS.max_tokens - 1  # each decode step, the prefill step not
    assert not graphs.eager
    # the reserved block was never handed to a sequence, and the engine's blocks are all free again
    manager = twin.engine.block_manager
    assert graphs.scratch_block not in manager.free_queue
    assert manager.num_free_blocks == manager.num_blocks - 1


def test_a_batch_that_shrinks_through_the_buckets_keeps_its_sequences_caches(make_tiny) -> None:
    """Sequences finishing one after another take the batch from 7 down through buckets 8, 4, 2 and 1, so
    rows a finished sequence held become padding; the same prompts again hit the prefix cache on the
    blocks those sequences filled, which padding must not have written."""
    model_dir = make_tiny("llama")
    params = [
        SamplingParams(temperature=0, max_tokens=2 + 3 * i, logprobs=2, ignore_eos=True) for i in range(7)
    ]

    def twice(llm: LLM) -> list:
        return [
            (o.outputs[0].token_ids, o.outputs[0].logprobs)
            for _ in range(2)
            for o in llm.generate(prompts(7), params)
        ]

    want = twice(engine(model_dir, twin=False))
    twin = engine(model_dir, twin=True)
    close(twice(twin), want)
    assert twin.engine.runner.graphs.replays > 20


def test_a_padded_step_hands_flashinfer_a_page_table_with_padding_on_the_reserved_block(make_tiny) -> None:
    """The metadata a graph's step plans from: the padded rows' one page is the reserved block, each
    holding pad_position + 1 keys; the real rows' pages are the eager step's."""
    twin = engine(make_tiny("llama"), twin=True)
    graphs = twin.engine.runner.graphs
    backend = twin.engine.runner.backend()
    seen = []

    def graph_metadata(meta, size):
        seen.append((size, page_table(meta.context_lens_list, meta.block_tables_list, meta.block_size)))
        assert meta.block_tables_list == [
            row[: len(blocks)]
            for row, blocks in zip(meta.block_tables.tolist(), meta.block_tables_list, strict=True)
        ]
        assert meta.context_lens.tolist() == meta.context_lens_list
        return original(meta, size)

    original, backend.graph_metadata = backend.graph_metadata, graph_metadata
    twin.generate(prompts(3), PARAMS)
    assert seen and all(size == 4 for size, _ in seen)
    for _, table in seen:
        assert table.indptr[-1] - table.indptr[-2] == 1  # the padding row: one page
        assert table.indices[-1] == graphs.scratch_block
        assert table.last_page_len[-1] == graphs.pad_position + 1
        assert graphs.scratch_block not in table.indices[: table.indptr[3]]


def test_a_bucket_that_cannot_be_captured_runs_eagerly_logged_once(make_tiny, caplog) -> None:
    """A failed capture (here: out of memory while the backend plans) costs no request: that step and the
    bucket's later ones run eagerly, one warning a process names it; other buckets still take theirs."""
    model_dir = make_tiny("llama")
    want = outputs(engine(model_dir, twin=False), 3)
    twin = engine(model_dir, twin=True)
    graphs = twin.engine.runner.graphs
    out_of_memory_at(twin, 4)
    clear_once_cache()
    with caplog.at_level(logging.DEBUG, logger="keepwarm_runtime.engine.decode_graphs"):
        close(outputs(twin, 3), want)
        assert graphs.eager == {4} and graphs.replays == 0
        close(outputs(twin, 1), outputs(engine(model_dir, twin=False), 1))
    assert graphs.replays > 0  # the bucket of 1 still served
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "4 sequences run eagerly" in warnings[0].getMessage()


@pytest.mark.parametrize(
    "failure",
    [
        GraphUnsupported("the pass needs more than one attention plan"),
        RuntimeError("CUDA error: operation not permitted when stream is capturing (stand-in)"),
    ],
)
def test_a_pass_no_graph_can_hold_sends_every_bucket_eager(make_tiny, failure) -> None:
    """Anything but memory fails every bucket alike (a second plan, a routing that syncs)."""
    model_dir = make_tiny("llama")
    twin = engine(model_dir, twin=True)
    graphs = twin.engine.runner.graphs
    backend = twin.engine.runner.backend()

    def graph_metadata(meta, size):
        raise failure

    backend.graph_metadata = graph_metadata
    close(outputs(twin, 2), outputs(engine(model_dir, twin=False), 2))
    assert graphs.eager == set(graphs.sizes) and graphs.replays == 0


def test_sleep_drops_the_graphs_and_wake_makes_them_again(make_tiny) -> None:
    from keepwarm_runtime.engine.sleep import sleep, wake

    model_dir = make_tiny("llama")
    want = outputs(engine(model_dir, twin=False), 5)
    twin = engine(model_dir, twin=True)
    before = twin.engine.runner.graphs
    report = sleep(twin.engine, level=1)
    assert twin.engine.runner.graphs is None
    wake(twin.engine, report.weights_released)
    after = twin.engine.runner.graphs
    assert after is not None and after is not before
    assert after.scratch_block not in twin.engine.block_manager.free_queue
    close(outputs(twin, 5), want)
    assert after.replays > 0


def test_the_step_benchmark_times_a_replayed_step_as_its_forward_pass(tmp_path) -> None:
    """bench/step.py's forward timer on steps served by the buckets: a replay runs no module on a GPU,
    so it is timed around the replay, and the twin's modules inside it are not counted twice."""
    import argparse

    from bench.step import _graphs, measure_batch
    from keepwarm_runtime.engine.config import EngineConfig
    from keepwarm_runtime.engine.llm_engine import LLMEngine
    from keepwarm_runtime.modelgen import make_model

    model_dir = make_model(tmp_path, arch="llama", params="1M", dtype="float32")  # the bench's vocab
    config = EngineConfig(str(model_dir), max_num_seqs=8, max_model_len=120, num_kv_blocks=200)
    engine = LLMEngine(config)
    engine.use_decode_graphs(capture=False)
    row = measure_batch(
        engine, 5, argparse.Namespace(steps=3, warmup=1, output_kind="cumulative"), lambda: None
    )
    assert row["tokens_per_forward"] == 5 and row["forward_ms"] > 0
    assert _graphs(engine)["replays"] >= 7  # warm-up and both timed passes
    assert "run" not in vars(engine.runner.graphs)  # the timer's wrapper is gone


def test_the_warm_up_request_captures_nothing(make_tiny) -> None:
    """A start pays for no capture: the warm-up request's decode step runs eagerly (buckets are captured
    once the server is ready), and the graphs are back for the steps after it."""
    twin = engine(make_tiny("llama"), twin=True)
    graphs = twin.engine.runner.graphs
    twin.engine.run_warm_up_request()
    assert graphs.replays == 0 and not graphs.buckets
    assert twin.engine.runner.graphs is graphs


def test_an_engine_with_one_kv_block_keeps_it_for_its_sequences(make_tiny) -> None:
    llm = LLM(make_tiny("llama"), dtype="float32", block_size=64, num_kv_blocks=1)
    llm.engine.use_decode_graphs(capture=False)
    assert llm.engine.runner.graphs is None and llm.engine.block_manager.num_free_blocks == 1
    assert len(llm.generate(prompts(1), PARAMS)[0].outputs[0].token_ids) == PARAMS.max_tokens


def test_an_idle_engine_captures_the_buckets_smallest_first_touching_no_sequences_cache(make_tiny) -> None:
    """``work_while_idle`` captures one bucket a call, smallest first, on a step of padding rows alone
    (the twin runs that pass): none while requests run, none left after the last. The prompts served
    before, asked again, hit the prefix cache on blocks those passes must not have written, and give
    the outputs of an engine without graphs."""
    model_dir = make_tiny("llama")
    want = outputs(engine(model_dir, twin=False), 5) * 2
    twin = engine(model_dir, twin=True)
    graphs = twin.engine.runner.graphs
    got = outputs(twin, 5)
    twin.engine.add_request("busy", prompts(1)[0]["prompt_token_ids"], PARAMS)
    assert not twin.engine.work_while_idle()  # a request is waiting
    twin.engine.abort_request("busy")
    assert set(graphs.buckets) == {8}  # five sequences' decode steps
    captured = []
    while twin.engine.work_while_idle():
        captured += sorted(set(graphs.buckets) - {8, *captured})
    assert captured == [1, 2, 4, 12] and not graphs.eager
    got += outputs(twin, 5)
    close(got, want)
    assert max(o.num_cached_tokens for o in twin.generate(prompts(5), PARAMS)) > 0  # hits were read


def test_an_idle_capture_out_of_memory_leaves_that_bucket_eager(make_tiny) -> None:
    twin = engine(make_tiny("llama"), twin=True)
    graphs = twin.engine.runner.graphs
    out_of_memory_at(twin, 2)
    while twin.engine.work_while_idle():
        pass
    assert graphs.eager == {2} and set(graphs.buckets) == set(graphs.sizes) - {2}
    close(outputs(twin, 2), outputs(engine(make_tiny("llama"), twin=False), 2))
