"""`keepwarm bench NAME ...`: run a benchmark script from the repository's bench/ folder.

Benchmarks live beside the code (bench/<name>.py, each with ``main(argv) -> int`` and ``--json``)
rather than in the package, so they can build large checkpoints and spawn fresh processes freely.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

# benchmark name -> help; each registers its flags in _ARGS and gets them back as argv
BENCHMARKS: dict[str, str] = {
    "restart": "time to first logits: from_pretrained vs disk vs warm cache attach (fresh processes)",
}


def _restart_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-gib", default="0.5", help="checkpoint size in GiB (bfloat16)")
    p.add_argument("--serving-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", default="2", help="runs per path; the best is reported")
    p.add_argument("--device", default="cpu", help="cpu (host tier) or cuda:N (gpu tier)")
    p.add_argument("--threads", default="1", help="torch threads per child process (0: torch default)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")


_ARGS = {"restart": _restart_args}


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="run a benchmark (prints JSON)")
    sub = bench.add_subparsers(dest="bench_name", required=True)
    for name, help_text in BENCHMARKS.items():
        p = sub.add_parser(name, help=help_text)
        _ARGS[name](p)
        p.set_defaults(handler=run)


def _argv(args: argparse.Namespace) -> list[str]:
    """The parsed flags of this benchmark, back as the argv its ``main`` expects."""
    skip = {"handler", "bench_name", "command", "log_level"}
    argv = []
    for key, value in vars(args).items():
        if key in skip or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        argv += [flag] if value is True else [flag, str(value)]
    return argv


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


def run(args: argparse.Namespace) -> int:
    return int(_import_bench(args.bench_name).main(_argv(args)) or 0)
