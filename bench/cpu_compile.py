"""What torch.compile of a CPU decode step's forward pass would give, beside the eager engine.

    .venv/bin/python -m bench.cpu_compile [--params 10M] [--batches 1,64] [--dtype float32]
        [--steps 60] [--rounds 3] [--threads 1] [--mode default] [--dir DIR] [--json-out FILE]

keepwarm runs its CPU forward pass eagerly (docs/performance.md, "torch.compile on CPU: measured, not
built"); this probe measures the alternative. Two engines of one generated Llama in one process: one
as it runs, one whose model's ``forward`` is wrapped in ``torch.compile(dynamic=True)`` (Inductor,
``--mode``). To trace the whole pass without graph breaks, while compiling:

* each attention layer's call is an opaque custom op (``kwprobe::attention``): the layer reads the
  step's metadata from a context variable and writes the paged cache, which Dynamo cannot trace;
* keepwarm's CPU kernels (engine/attention/csrc) get fake implementations (shapes only);
* the attention dispatch's scale check uses plain arithmetic instead of ``math.isclose`` (a graph
  break under Dynamo).

The eager engine runs the same code paths (the patches act only while Dynamo traces). For each batch
size, the same greedy requests (prompts of 16..47 tokens, EOS ignored) go to both engines; the
compiled engine's first steps, which compile, are timed apart (``compile_s``); then --rounds rounds
alternate the two engines, --steps decode steps each, and report the median and the fastest step of
every round. ``tokens_equal``: both engines generated the same greedy tokens. Prints one JSON document.
A benchmark, not a test; a probe, not a feature: nothing here is used by ``keepwarm serve``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.step import PROMPT_MAX, admit, machine
from keepwarm_runtime.bench_cli import publish

WARM_STEPS = 8  # compiled engine: the steps that trace and compile (decode shapes 1 and > 1 tokens)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", default="10M", help="the generated Llama's size")
    p.add_argument("--batches", default="1,64", help="comma-separated batch sizes")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--steps", type=int, default=60, help="decode steps per engine per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds, the two engines alternating")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (engine/threads.py)")
    p.add_argument("--mode", default="default", help="torch.compile mode (or max-autotune-no-cudagraphs)")
    p.add_argument("--dir", default=None, help="where the checkpoint is generated and kept (default: temp)")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.steps < 1 or args.rounds < 1 or min(args.batches) < 1:
        p.error("--steps, --rounds and every batch size must be at least 1")
    return args


def _register_fakes() -> None:
    """Shapes-only implementations of keepwarm's CPU kernels, so that Dynamo traces through them (once
    a process, as the probe's custom op is defined)."""
    import torch

    def linear(x, weight, bias=None):
        return x.new_empty(*x.shape[:-1], weight.shape[0])

    def gate_up(x, gate, up):
        return x.new_empty(*x.shape[:-1], gate.shape[0])

    def writes(*args, **kwargs) -> None:  # the ops that write into their first arguments
        return None

    for name, fake in {
        "f32_linear": linear,
        "bf16_linear": linear,
        "amx_linear": linear,
        "amx_gate_up_silu": gate_up,
        "rms_norm": writes,
        "gemma_rms_norm": writes,
        "add_rms_norm": writes,
        "silu_and_mul": writes,
        "silu_and_mul_halves": writes,
        "gelu_tanh_and_mul": writes,
        "rotary_embedding": writes,
        "rotary_embedding_pairs": writes,
    }.items():
        torch.library.register_fake(f"keepwarm_cpu::{name}")(fake)


@contextlib.contextmanager
def traceable_attention() -> Iterator[Callable[[Any], None]]:
    """While Dynamo traces, each KeepwarmAttention call is the opaque op ``kwprobe::attention``; yields
    the function that numbers a model's attention layers for it (call it before compiling)."""
    import torch

    from keepwarm_runtime.engine.attention import dispatch
    from keepwarm_runtime.engine.attention import layer as layer_module

    eager_forward = layer_module.KeepwarmAttention.forward
    layers: list = []
    schema = "(Tensor query, Tensor key, Tensor value, int index) -> Tensor"

    @torch.library.custom_op("kwprobe::attention", mutates_args=(), schema=schema)
    def attention(query, key, value, index):
        return eager_forward(layers[index], query, key, value).clone()  # a custom op returns new memory

    @attention.register_fake
    def _(query, key, value, index):
        return query.new_empty(1, query.shape[2], query.shape[1], value.shape[-1])

    def forward(self, query, key, value, sliding_window=None, softcap=None, sinks=None):
        if not torch.compiler.is_compiling():
            return eager_forward(self, query, key, value, sliding_window, softcap, sinks)
        if sliding_window is not None or softcap is not None or sinks is not None:
            raise NotImplementedError("the probe compiles plain causal attention (Llama) only")
        return attention(query, key, value, self.probe_index)

    def register(model) -> None:
        for module in model.modules():
            if isinstance(module, layer_module.KeepwarmAttention):
                module.probe_index = len(layers)
                layers.append(module)

    isclose = types.SimpleNamespace(isclose=lambda a, b, rel_tol: abs(a - b) <= rel_tol * max(abs(a), abs(b)))
    saved_math = dispatch.math
    layer_module.KeepwarmAttention.forward = forward
    dispatch.math = isclose
    try:
        yield register
    finally:
        layer_module.KeepwarmAttention.forward = eager_forward
        dispatch.math = saved_math


def engine_for(model_dir: Path, args: argparse.Namespace):
    from keepwarm_runtime.engine.config import EngineConfig
    from keepwarm_runtime.engine.llm_engine import LLMEngine

    longest = PROMPT_MAX + WARM_STEPS + args.rounds * args.steps + 8
    block = EngineConfig.block_size
    config = EngineConfig(
        str(model_dir),
        dtype=args.dtype,
        device="cpu",
        max_num_seqs=max(args.batches),
        max_model_len=longest,
        num_kv_blocks=max(args.batches) * -(-longest // block) + 1,
    )
    engine = LLMEngine(config)
    engine.run_warm_up_request()
    return engine


def timed_steps(engine, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    return times


def measure_batch(eager, compiled, batch: int, args: argparse.Namespace) -> dict:
    from keepwarm_runtime import RequestOutputKind

    final = RequestOutputKind.FINAL_ONLY
    eager_ids, compiled_ids = admit(eager, batch, final, "eager"), admit(compiled, batch, final, "compiled")
    compile_times = timed_steps(compiled, WARM_STEPS)
    warm = timed_steps(eager, WARM_STEPS)
    rounds: dict[str, list[dict]] = {"eager": [], "compiled": []}
    for _ in range(args.rounds):
        for name, engine in (("eager", eager), ("compiled", compiled)):
            times = timed_steps(engine, args.steps)
            rounds[name].append(
                {"median_ms": round(statistics.median(times) * 1e3, 3), "min_ms": round(min(times) * 1e3, 3)}
            )
    tokens = [
        [engine.requests[r].seqs[0].output_token_ids for r in ids]
        for engine, ids in ((eager, eager_ids), (compiled, compiled_ids))
    ]
    for engine, ids in ((eager, eager_ids), (compiled, compiled_ids)):
        for request_id in ids:
            engine.abort_request(request_id)
    best = {name: min(r["median_ms"] for r in rs) for name, rs in rounds.items()}
    return {
        "batch": batch,
        "compile_s": round(sum(compile_times) - sum(warm), 2),
        "rounds": rounds,
        "eager_over_compiled": round(best["eager"] / best["compiled"], 3),
        "tokens_equal": tokens[0] == tokens[1],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from keepwarm_runtime.engine import threads

    threads.use_threads(threads.ThreadChoice(args.threads, "--threads"))
    import torch
    import torch._dynamo

    from keepwarm_runtime.engine.attention import native
    from keepwarm_runtime.modelgen import make_model

    native.load()
    _register_fakes()
    torch._dynamo.config.cache_size_limit = 64  # one graph for 1 token, one for more (dynamic)
    result: dict = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "params": args.params,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "mode": args.mode,
        "steps": args.steps,
        "machine": machine(),
    }
    with tempfile.TemporaryDirectory(prefix="keepwarm-compile-") as tmp, traceable_attention() as register:
        root = Path(args.dir).expanduser() if args.dir else Path(tmp)
        model_dir = root / f"llama-{args.params}-{args.dtype}"
        if not (model_dir / "config.json").exists():
            make_model(model_dir, arch="llama", params=args.params, dtype=args.dtype)
        eager, compiled = engine_for(model_dir, args), engine_for(model_dir, args)
        model = compiled.runner.model
        register(model)
        model.forward = torch.compile(
            model.forward, dynamic=True, mode=None if args.mode == "default" else args.mode
        )
        result["batches"] = [measure_batch(eager, compiled, batch, args) for batch in args.batches]
    result["load_average_1m_after"] = round(os.getloadavg()[0], 2)
    publish(result, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
