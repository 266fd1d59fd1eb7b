"""Issue 35's CPU table in one sitting: keepwarm beside vLLM's CPU build on each row, as a Markdown table.

    .venv/bin/python -m bench.cpu_table [--rows issue[,families]] [--peers vllm] [--rounds 3]
        [--threads 1] [--params 1M] [--dir DIR] [--json-out FILE] [-- extra bench/throughput.py flags]

Each row is one ``bench/throughput.py`` run in a process of its own (so one row's memory and threads
never weigh on the next), the rows one after another: ``issue`` is the four rows issue 35 is judged
on (10M and 100M Llama in float32 and the 100M in bfloat16, 64 prompts x 128 tokens; the 100M in
bfloat16 on 32 mixed prompts of 16-256 tokens and 8-192 outputs), ``families`` adds a generated Qwen3
and Gemma 3 (10M float32, 100M bfloat16, 10M bfloat16). Every run names its peers (``--peers``: vLLM,
or keepwarm's own switches such as ``keepwarm_no_amx``) and rotates through ``--rounds`` rounds, the
best of each counting. Prints the table (tokens/s, keepwarm over each peer, sequences identical to
keepwarm's) and writes every row's JSON with the machine's flags and the commit to --json-out. Where
the CPU cannot run vLLM's build, its column says why. ``--params 1M`` makes every row's model that
size instead (a smoke run). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from keepwarm_runtime.bench_cli import publish

REPO = Path(__file__).resolve().parents[1]


FAMILIES = {
    "llama": "",
    "qwen3": "Qwen3 ",
    "gemma3": "Gemma 3 ",
}  # a row's name: Llama's rows are the issue's
MIXED = ("--workload", "mixed", "--prompts", "32", "--max-prompt-len", "256", "--max-output-len", "192")


@dataclass(frozen=True)
class Row:
    """One row of the table: a generated model and a workload, as bench/throughput.py's flags."""

    arch: str
    params: str
    dtype: str
    workload: tuple[str, ...] = ()  # the mixed workload's flags; empty: 64 prompts x 128 tokens

    def name(self, params: str) -> str:
        shape = "32 mixed prompts" if self.workload else "64 x 128"
        return f"{FAMILIES[self.arch]}{params}, {self.dtype}, {shape}"

    def flags(self, model_dir: Path) -> list[str]:
        return ["--model-dir", str(model_dir), "--dtype", self.dtype, *self.workload]


ROWS = {
    "issue": (
        Row("llama", "10M", "float32"),
        Row("llama", "100M", "float32"),
        Row("llama", "100M", "bfloat16"),
        Row("llama", "100M", "bfloat16", MIXED),
    ),
    "families": (
        Row("qwen3", "10M", "float32"),
        Row("qwen3", "100M", "bfloat16"),
        Row("gemma3", "10M", "bfloat16"),
    ),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="issue", help=f"comma-separated, of {', '.join(ROWS)}")
    p.add_argument("--peers", default="vllm", help="bench/throughput.py's --peers for every row")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--params", default=None, help="every row's model at this size instead (a smoke run)")
    p.add_argument("--dir", default=None, help="where generated models are kept (default: a temporary one)")
    p.add_argument("--json-out", default=None)
    p.add_argument("extra", nargs="*", help="after --: more bench/throughput.py flags for every row")
    args = p.parse_args(argv)
    unknown = [name for name in args.rows.split(",") if name not in ROWS]
    if unknown:
        p.error(f"--rows: unknown {', '.join(unknown)}; use {', '.join(ROWS)}")
    if args.rounds < 1 or args.threads < 1:
        p.error("--rounds and --threads must be at least 1")
    return args


def model_dir(row: Row, params: str, root: Path) -> Path:
    """The row's generated model, made once per architecture, size and dtype (`keepwarm make-model`)."""
    from keepwarm_runtime.modelgen import make_model

    path = root / f"{row.arch}-{params}-{row.dtype}"
    if not (path / "config.json").exists():
        make_model(path, arch=row.arch, params=params, dtype=row.dtype)
    return path


def run_row(row: Row, args: argparse.Namespace, root: Path, out: Path) -> dict:
    params = args.params or row.params
    argv = [
        sys.executable,
        str(REPO / "bench" / "throughput.py"),
        *row.flags(model_dir(row, params, root)),
    ]
    argv += ["--peers", args.peers, "--rounds", str(args.rounds), "--threads", str(args.threads)]
    argv += [*args.extra, "--json-out", str(out)]
    print(f"{row.name(params)}: {' '.join(argv[1:])}", file=sys.stderr, flush=True)
    subprocess.run(argv, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def peers_of(result: dict) -> list[str]:
    """The peers a row's run reported, in its order (those skipped included)."""
    return [
        k
        for k, v in result.items()
        if isinstance(v, dict) and k != "keepwarm" and ("tokens_per_s" in v or "skipped" in v)
    ]


def table(rows: list[tuple[str, dict]]) -> str:
    """The Markdown table: per row keepwarm's tokens/s, each peer's, and keepwarm over the peer."""
    peers = list(dict.fromkeys(p for _, result in rows for p in peers_of(result)))
    head = ["model, dtype, workload", "keepwarm tok/s"]
    for peer in peers:
        head += [f"{peer} tok/s", f"keepwarm / {peer}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, result in rows:
        ours = result["keepwarm"]["tokens_per_s"]
        cells = [name, f"{ours:,.1f}"]
        for peer in peers:
            theirs = result.get(peer, {})
            if "tokens_per_s" in theirs:
                same = theirs.get("sequences_identical")
                cells += [
                    f"{theirs['tokens_per_s']:,.1f}",
                    f"**{ours / theirs['tokens_per_s']:.2f}** ({same} identical)",
                ]
            else:
                cells += [theirs.get("skipped", "not run"), ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def commit() -> str | None:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return done.stdout.strip() or None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from bench.step import cpu_model
    from keepwarm_runtime.engine.attention.native import cpu_flags

    rows = [row for name in args.rows.split(",") for row in ROWS[name]]
    with tempfile.TemporaryDirectory(prefix="keepwarm-table-") as tmp:
        root = Path(args.dir) if args.dir else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        results = [
            (row.name(args.params or row.params), run_row(row, args, root, Path(tmp) / f"row{i}.json"))
            for i, row in enumerate(rows)
        ]
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx")) or f == "avx2")
    markdown = table(results)
    print(markdown, file=sys.stderr)
    publish(
        {
            "benchmark": "cpu_table",
            "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": commit(),
            "machine": {
                "cpus": os.cpu_count(),
                "cpu_model": cpu_model(),
                "cpu_flags": flags,
                "load_average_1m": round(os.getloadavg()[0], 2),
            },
            "threads": args.threads,
            "rounds": args.rounds,
            "peers": args.peers,
            "table": markdown,
            "rows": [{"row": name, **result} for name, result in results],
        },
        args.json_out,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
