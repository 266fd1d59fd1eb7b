"""`keepwarm bench NAME ...`: run a benchmark script from the repository's bench/ folder.

Benchmarks live beside the code (bench/<name>.py, each with ``main(argv) -> int`` for its own command
line) rather than in the package, so they can build large checkpoints and spawn fresh processes
freely. Every one is registered here. Those in BENCHMARKS also have ``report(settings) -> int``:
their settings are declared here (keepwarm_api.settings), so that `keepwarm --help` lists them
without importing the benchmark, and the parsed settings object, not argv, reaches the benchmark.
The others (FORWARDED) keep their own argparse flags: `keepwarm bench NAME ARGS` hands ARGS to
their ``main`` unread (`keepwarm bench NAME --help` prints the benchmark's own help).
Every benchmark ends with ``publish``: its JSON on stdout, and in --json-out's file when given.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from keepwarm_api.settings import SettingError, add_command, resolve, setting
from keepwarm_api.values import DType

# Default torch threads per child: 1. On a small shared machine, OpenMP threads that wait for a
# descheduled sibling make a forward pass ~8x slower (measured: 5.3 s with 2 threads, 0.63 s with 1,
# 1 GiB float32 model, 2 cores at load ~5); the same setting applies to every path.
DEFAULT_THREADS = 1
# The benchmarks generate bfloat16 checkpoints and serve them as they are or widened to float32.
BENCH_DTYPES = (DType.FLOAT32.value, DType.BFLOAT16.value)


@dataclass(frozen=True)
class RestartSettings:
    """`keepwarm bench restart` (bench/restart.py)."""

    ENV_PREFIX: ClassVar[str] = "KEEPWARM_BENCH_"

    size_gib: float = setting(0.5, "checkpoint size in GiB (bfloat16)")
    serving_dtype: str = setting("float32", "dtype the weights are served in", choices=BENCH_DTYPES)
    repeats: int = setting(2, "runs per path; the best is reported")
    device: str = setting("cpu", "cpu (host tier) or cuda:N (gpu tier)")
    threads: int = setting(DEFAULT_THREADS, "torch threads per child process (0: torch default)")
    dir: str | None = setting(
        None, "where checkpoints are generated and kept", unset="~/.cache/keepwarm/bench"
    )
    json: bool = setting(False, "one JSON object on stdout")
    drop_caches: bool = setting(
        False, "root only: sync and drop the page cache before each cold (disk-reading) path"
    )
    serve: bool = setting(True, "also time whole `keepwarm serve` starts to /ready, phase by phase")
    tensor_parallel: int = setting(
        1,
        "time a group of this many tensor-parallel ranks against one rank instead: `keepwarm serve` "
        "starts from disk and from the cache (shards), each rank's weights phase, and throughput "
        "(bench/_restart_group.py)",
    )
    snapshot: bool = setting(
        False,
        "root only: also time whole `keepwarm serve` starts in a pod's namespaces restored from the "
        "node's process snapshot (snapshot_ready_s) beside the same start importing (imports_ready_s)",
    )
    criu: str = setting(
        "criu", "CRIU for --snapshot: a path (scripts/criu/build.sh prints its directory) or a name on PATH"
    )


@dataclass(frozen=True)
class RecoverySettings:
    """`keepwarm bench recovery` (bench/recovery.py)."""

    ENV_PREFIX: ClassVar[str] = "KEEPWARM_BENCH_"

    params: str = setting("500M", "size of the generated Llama checkpoint (the demo's: 500M)")
    serving_dtype: str = setting("float32", "dtype the weights are served in", choices=BENCH_DTYPES)
    repeats: int = setting(3, "crashes and wakes timed; the best and every run are reported")
    threads: int = setting(0, "the servers' --threads (0: their own choice)")
    dir: str | None = setting(
        None, "where checkpoints are generated and kept", unset="~/.cache/keepwarm/bench"
    )
    json: bool = setting(False, "one JSON object on stdout")


# benchmark name -> (help, settings class)
BENCHMARKS: dict[str, tuple[str, type]] = {
    "restart": (
        "time to first token and to a ready server: from_pretrained vs the engine from disk or the warm "
        "cache (fresh processes)",
        RestartSettings,
    ),
    "recovery": (
        "a warm `keepwarm serve` side by side: fresh process to ready, with the supervising parent, worker "
        "crash to first token, wake from sleep to first token",
        RecoverySettings,
    ),
}


# benchmark name -> help; its flags are bench/<name>.py's own (main(argv) parses them)
FORWARDED: dict[str, str] = {
    "throughput": "offline throughput: keepwarm's engine vs transformers' own engines and vLLM, same prompts",
    "step": "one decode step taken apart: the whole step, its forward pass and the host's share, per batch",
    "cpu_table": "issue 35's CPU table in one sitting: each row's keepwarm beside vLLM (or a switch)",
    "cpu_attention": "the CPU decode attention kernel alone, warm and cold, per dtype and context length",
    "cpu_linear": "bfloat16 linear layers per step size: the AMX kernel beside oneDNN, weights from memory",
    "cpu_compile": "torch.compile of the CPU forward pass beside the eager engine (a probe, not a feature)",
    "serve": "`keepwarm serve` vs `transformers serve` under the same open-loop load",
    "streams": "`keepwarm serve` at saturation, streamed beside unstreamed: tokens/s, event loop CPU a token",
    "stream_text": "a streamed token's bookkeeping (put together, tool hold-back, new text) as outputs grow",
    "contention": "engine tokens/s alone vs beside a CPU hog, keepwarm's thread settings vs torch's",
    "handoff": "how long the node's cache is cold when its daemon is upgraded or killed",
    "lora": "LoRA adapters: load time per rank, mixed-adapter throughput vs the base and vs PEFT",
    "moe": "one MoE layer per backend and weight format: tokens/s and FP8/bf16 bytes",
    "audio": "audio decode + resample throughput per backend at 1, 8 and 32 concurrent requests",
    "operator_scale": "the operator on the test control plane: N InferenceDeployments over M fake nodes",
    "pod_restart": "a pod restart as a user sees it, on real pods (root): delete, crash, scale 0 -> 1",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="run a benchmark (prints JSON)")
    sub = bench.add_subparsers(dest="bench_name", required=True)
    for name, (help_text, settings) in BENCHMARKS.items():
        add_command(sub, name, settings, help_text, run)
    for name, help_text in FORWARDED.items():
        # no flags of its own (prefix "+"), so every argument, --help too, reaches the benchmark
        forwarded = sub.add_parser(name, help=help_text, add_help=False, prefix_chars="+")
        forwarded.add_argument("bench_argv", nargs=argparse.REMAINDER)
        forwarded.set_defaults(handler=run_forwarded)


def publish(result: dict, json_out: str | Path | None) -> None:
    """Print a benchmark's result as indented JSON, and write it to ``json_out`` when one is given."""
    text = json.dumps(result, indent=2)
    print(text)
    if json_out:
        Path(json_out).write_text(text + "\n")


def _import_bench(name: str):
    try:
        return importlib.import_module(f"bench.{name}")
    except ModuleNotFoundError:
        repo = Path(__file__).resolve().parents[2]  # runtime/keepwarm_runtime/ -> repository root
        if not (repo / "bench" / f"{name}.py").exists():
            raise SystemExit(
                f"keepwarm bench {name}: bench/{name}.py not found; run from a checkout"
            ) from None
        sys.path.insert(0, str(repo))
        return importlib.import_module(f"bench.{name}")


def run_forwarded(args: argparse.Namespace) -> int:
    return int(_import_bench(args.bench_name).main(args.bench_argv) or 0)


def run(args: argparse.Namespace) -> int:
    try:
        settings = resolve(BENCHMARKS[args.bench_name][1], args, os.environ)
    except SettingError as exc:
        print(f"keepwarm bench {args.bench_name}: {exc}", file=sys.stderr)
        return 2
    return int(_import_bench(args.bench_name).report(settings) or 0)
