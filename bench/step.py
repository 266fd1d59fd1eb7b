"""One decode step, taken apart: the whole step, the model's forward pass and the host's share of it.

    .venv/bin/python bench/step.py [--params 10M,100M] [--arch llama] [--batches 1,16,64,256]
        [--dtype float32] [--device cpu] [--threads 1] [--steps 16] [--warmup 3] [--attention-backend auto]
        [--dir DIR] [--no-cpu-fused-ops] [--enforce-eager] [--[no-]async-scheduling]
        [--output-kind delta] [--json-out FILE]

For each generated model (--arch, a Llama by default, of each --params size, made once per run, or
kept in --dir) one engine serves each batch
size in turn: that many greedy requests (prompts of 16..47 tokens, EOS ignored) are admitted and
prefilled, then --warmup decode steps run untimed and two timed passes of --steps decode steps each:

* ``step_ms``: the first pass, nothing attached: the wall time of ``engine.step()`` as a server's loop
  sees it (the median step; ``step_mean_ms`` is the pass's wall time over its steps, where work that one
  step leaves to the next, as the overlapped loop does (engine/overlap.py), is counted once);
* ``forward_ms`` and ``host_ms``: the second pass, one step at a time (each step landed before the next
  is scheduled: ``LLMEngine.settle``), with the model's forward pass timed by hooks that synchronise the
  device before and after it; ``host_ms`` is the rest of the step (scheduling, inputs, sampling,
  detokenising, outputs), both as medians.
  ``overlap_ms`` is what the first pass hid of their sum (``--no-async-scheduling``: steps one at a
  time in both passes; the engine's default overlaps on CUDA only).
* ``--output-kind``: the requests' RequestOutputKind: ``delta`` (an output at every step holding
  what it added, as the server's streams ask for), ``cumulative`` (an output at every step with
  everything so far, as ``LLMEngine`` gives by default) or ``final_only`` (an output when a request
  finishes, as a request that does not stream has; no timed step finishes one, so a timed step
  builds no output and detokenises nothing).
* ``*_cpu_ms``: the same medians in this process's CPU time (all its threads). On a shared machine the
  wall times grow with the neighbours' load while CPU time mostly does not, so compare CPU times
  between runs at different loads, wall times within one run.

Every timed step must decode exactly the batch, one token per sequence (``tokens_per_forward``); the
script stops with an error otherwise. Threads: --threads intra-op threads with keepwarm's OpenMP
settings (engine/threads.py), 1 by default, as the issue's side-by-side runs use (on a small shared
machine a second thread waits for a descheduled sibling). Prints one JSON document. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from keepwarm_runtime.bench_cli import publish
from keepwarm_runtime.modelgen.architectures import ARCHITECTURES

BATCHES = (1, 16, 64, 256)
PROMPT_MIN, PROMPT_MAX = 16, 48  # prompt lengths, as bench/throughput.py's fixed workload
PARAMS = ("10M", "100M")
# CPU flags that decide which kernels run (AVX-512 and AMX: oneDNN's bfloat16; AVX2: the emulated path).
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", default=",".join(PARAMS), help="comma-separated model sizes")
    p.add_argument(
        "--arch", default="llama", choices=sorted(ARCHITECTURES), help="the generated model's architecture"
    )
    p.add_argument("--batches", default=",".join(map(str, BATCHES)), help="comma-separated batch sizes")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per pass")
    p.add_argument("--warmup", type=int, default=3, help="untimed decode steps first")
    p.add_argument("--attention-backend", default="auto", help="auto | torch | cpu | flashinfer")
    p.add_argument(
        "--dir", default=None, help="where checkpoints are generated and kept (default: a temp dir)"
    )
    p.add_argument(
        "--no-cpu-fused-ops",
        dest="cpu_fused_ops",
        action="store_false",
        help="without keepwarm's fused CPU kernels (engine/cpu_fused.py): the figures before them",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="CUDA: no decode graphs (engine/decode_graphs.py), every step launched from Python",
    )
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="overlapped steps (engine/overlap.py) or one at a time (default: the engine's, on CUDA only)",
    )
    p.add_argument(
        "--output-kind",
        default="delta",
        choices=("delta", "cumulative", "final_only"),
        help="the requests' RequestOutputKind (what the server asks for: delta for streams, final_only "
        "for responses that do not stream)",
    )
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    args.params = [x for x in args.params.split(",") if x]
    try:
        args.batches = [int(x) for x in args.batches.split(",") if x]
    except ValueError:
        p.error("--batches: comma-separated whole numbers")
    if not args.params or not args.batches or min(args.batches) < 1:
        p.error("--params and --batches need at least one value each; batches are at least 1")
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be at least 1 and --warmup at least 0")
    return args


def cpu_model(cpuinfo: str | None = None) -> str:
    """The first processor's model name in /proc/cpuinfo ("" where there is none): two CPUs of one flag
    set differ in speed (an AMD EPYC runs AVX-512 on other units than a Xeon), so it goes beside them."""
    from keepwarm_runtime.engine.auto_dtype import cpuinfo_field, this_cpu

    return this_cpu("model name") if cpuinfo is None else cpuinfo_field(cpuinfo, "model name")


def machine() -> dict:
    """What the figures depend on: the CPU's model and flags, cores, the load beside the run."""
    from keepwarm_runtime.engine.attention.native import cpu_flags

    flags = cpu_flags()
    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
        "cpu_flags": [f for f in FLAGS if f in flags],
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


class ForwardTimer:
    """Times the model's forward pass by hooks, synchronising the device around it when one is given;
    a step replayed from a decode graph (engine/decode_graphs.py), which runs no module, is timed around
    the replay instead."""

    def __init__(self, runner, sync) -> None:
        self.sync = sync  # a no-op on CPU, torch.cuda.synchronize on CUDA
        self.seconds: list[float] = []
        self.cpu_seconds: list[float] = []
        self.tokens: list[int] = []  # tokens in each forward pass
        self._started = self._cpu_started = 0.0
        self._replaying = False
        model = runner.model
        self._hooks = [
            model.register_forward_pre_hook(self._before, with_kwargs=True),
            model.register_forward_hook(self._after, with_kwargs=True),
        ]
        self._graphs = runner.graphs
        if self._graphs is not None:
            self._graphs.run = self._replay(self._graphs.run)  # shadows the method until remove()

    def _replay(self, run):
        def timed(ids, positions, meta):
            self.sync()
            started, cpu_started = time.perf_counter(), time.process_time()
            self._replaying = True  # the CPU twin runs the model inside: its hooks stay quiet
            try:
                logits = run(ids, positions, meta)
            finally:
                self._replaying = False
            if logits is not None:  # None: the step runs eagerly, timed by the hooks
                self.sync()
                self.tokens.append(int(ids.shape[0]))
                self.seconds.append(time.perf_counter() - started)
                self.cpu_seconds.append(time.process_time() - cpu_started)
            return logits

        return timed

    def _before(self, module, args, kwargs) -> None:
        if self._replaying:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.tokens.append(int(ids.shape[-1]) if ids is not None else -1)
        self.sync()
        self._started, self._cpu_started = time.perf_counter(), time.process_time()

    def _after(self, module, args, kwargs, output) -> None:
        if self._replaying:
            return
        self.sync()
        self.seconds.append(time.perf_counter() - self._started)
        self.cpu_seconds.append(time.process_time() - self._cpu_started)

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        if self._graphs is not None:
            del self._graphs.run


def admit(engine, batch: int, output_kind, tag: str = "step") -> list[str]:
    """``batch`` greedy requests that outlast the timed steps (prompts of PROMPT_MIN..PROMPT_MAX - 1
    random token ids, seeded by ``batch``, EOS ignored), admitted and prefilled; their ids."""
    import torch

    from keepwarm_runtime import SamplingParams

    g = torch.Generator().manual_seed(batch)
    # Enough tokens that none finishes: the first admitted decode while later ones are still prefilled.
    params = SamplingParams(
        temperature=0, max_tokens=engine.max_model_len - PROMPT_MAX, ignore_eos=True, output_kind=output_kind
    )
    ids = [f"{tag}-{batch}-{i}" for i in range(batch)]
    for i, request_id in enumerate(ids):
        prompt = torch.randint(10, 8000, (PROMPT_MIN + i % (PROMPT_MAX - PROMPT_MIN),), generator=g).tolist()
        engine.add_request(request_id, prompt, params)
    while any(not engine.requests[r].seqs[0].output_token_ids for r in ids):  # prefill (chunks) first
        engine.step()
    return ids


def measure_batch(engine, batch: int, args: argparse.Namespace, sync) -> dict:
    """Admit ``batch`` requests, prefill them, then time decode steps as the module docstring says."""
    from keepwarm_runtime import RequestOutputKind

    ids = admit(engine, batch, RequestOutputKind(args.output_kind))
    for _ in range(args.warmup):
        engine.step()
    sync()
    steps, cpu = [], []
    started = time.perf_counter()
    for _ in range(args.steps):
        t, c = time.perf_counter(), time.process_time()
        engine.step()
        steps.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    sync()
    wall = time.perf_counter() - started
    engine.settle()  # the step left running: its forward pass is not the timer's
    timer = ForwardTimer(engine.runner, sync)
    synced, synced_cpu = [], []
    try:
        for _ in range(args.steps):
            t, c = time.perf_counter(), time.process_time()
            engine.step()
            engine.settle()
            sync()
            synced.append(time.perf_counter() - t)
            synced_cpu.append(time.process_time() - c)
    finally:
        timer.remove()
    context = sum(engine.requests[r].seqs[0].num_tokens for r in ids) / batch
    for request_id in ids:
        engine.abort_request(request_id)
    if set(timer.tokens) != {batch} or len(timer.seconds) != args.steps:
        raise SystemExit(
            f"batch {batch}: the timed steps were not pure decodes of the batch "
            f"(tokens per forward pass: {sorted(set(timer.tokens))}, forward passes: {len(timer.seconds)})"
        )
    step_ms = _median_ms(steps)
    forward_ms = _median_ms(timer.seconds)
    host_ms = _median_ms(s - f for s, f in zip(synced, timer.seconds, strict=True))
    return {
        "batch": batch,
        "step_ms": step_ms,
        "step_mean_ms": round(wall / args.steps * 1e3, 3),
        "forward_ms": forward_ms,
        "host_ms": host_ms,
        "overlap_ms": round(max(0.0, forward_ms + host_ms - step_ms), 3),
        "step_cpu_ms": _median_ms(cpu),
        "forward_cpu_ms": _median_ms(timer.cpu_seconds),
        "host_cpu_ms": _median_ms(s - f for s, f in zip(synced_cpu, timer.cpu_seconds, strict=True)),
        "tokens_per_s": round(batch * args.steps / wall, 1),
        "tokens_per_forward": batch,
        "mean_context_tokens": round(context, 1),
    }


def _median_ms(seconds) -> float:
    return round(statistics.median(seconds) * 1e3, 3)


def measure_model(params: str, args: argparse.Namespace, root: Path) -> dict:
    import torch

    from keepwarm_runtime.engine.config import EngineConfig
    from keepwarm_runtime.engine.llm_engine import LLMEngine
    from keepwarm_runtime.modelgen import make_model

    model_dir = root / f"{args.arch}-{params}-{args.dtype}"
    if not (model_dir / "config.json").exists():
        make_model(model_dir, arch=args.arch, params=params, dtype=args.dtype)
    # Room for the decode steps while the batch is prefilled (chunks of max_num_batched_tokens) and timed.
    prefill_steps = -(-max(args.batches) * PROMPT_MAX // EngineConfig.max_num_batched_tokens) + 1
    longest = PROMPT_MAX + prefill_steps + args.warmup + 2 * args.steps + 2
    block = EngineConfig.block_size
    config = EngineConfig(
        str(model_dir),
        dtype=args.dtype,
        device=args.device,
        attention_backend=args.attention_backend,
        max_num_seqs=max(args.batches),
        max_model_len=longest,
        num_kv_blocks=max(args.batches) * -(-longest // block) + 1,
        cpu_fused_ops=args.cpu_fused_ops,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
    )
    started = time.perf_counter()
    engine = LLMEngine(config)
    engine.run_warm_up_request()  # a step before the clock, on CPU too
    load_s = time.perf_counter() - started
    device = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    rows = []
    for batch in args.batches:
        rows.append(measure_batch(engine, batch, args, sync))
        print(f"{params} batch {batch}: {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    return {
        "params": params,
        "attention_backend": engine.attention_backend,
        "decode_graphs": _graphs(engine),
        "async_scheduling": engine.async_scheduling,
        "engine_start_s": round(load_s, 2),
        "batches": rows,
    }


def _graphs(engine) -> dict | None:
    """The decode graphs the steps used (CUDA): buckets captured and buckets that fell back to eager."""
    graphs = engine.runner.graphs
    if graphs is None:
        return None
    captured = sorted(size for size, entry in graphs.buckets.items() if entry.graph is not None)
    return {"captured": captured, "eager": sorted(graphs.eager), "replays": graphs.replays}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from keepwarm_runtime.engine import threads

    threads.use_threads(threads.ThreadChoice(args.threads, "--threads"))  # before torch, as serve does
    import torch

    result: dict = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "dtype": args.dtype,
        "device": args.device,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "steps": args.steps,
        "cpu_fused_ops": args.cpu_fused_ops,
        "output_kind": args.output_kind,
        "arch": args.arch,
        "machine": machine(),
    }
    with tempfile.TemporaryDirectory(prefix="keepwarm-step-") as tmp:
        root = Path(args.dir).expanduser() if args.dir else Path(tmp)
        result["models"] = [measure_model(params, args, root) for params in args.params]
    result["load_average_1m_after"] = round(os.getloadavg()[0], 2)
    publish(result, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
