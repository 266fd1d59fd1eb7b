"""`keepwarm bench NAME`: every benchmark in bench/ is registered, and a forwarded one gets its own
flags (--help too) unread."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from keepwarm_runtime.bench_cli import BENCHMARKS, FORWARDED
from keepwarm_runtime.cli import main

BENCH = Path(__file__).resolve().parents[3] / "bench"


def test_every_benchmark_script_is_registered_once() -> None:
    scripts = {p.stem for p in BENCH.glob("*.py") if not p.name.startswith("_")}
    assert not set(BENCHMARKS) & set(FORWARDED)
    assert set(BENCHMARKS) | set(FORWARDED) == scripts


def test_a_forwarded_benchmark_prints_its_own_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "moe", "--help"])
    assert exit_.value.code == 0
    assert "--experts" in capsys.readouterr().out


def test_a_forwarded_benchmark_runs_with_its_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    threads = torch.get_num_threads()  # the benchmark sets torch's threads (--threads): restored below
    monkeypatch.setenv("OMP_NUM_THREADS", str(threads))  # and defaults this variable
    out = tmp_path / "moe.json"
    argv = ["--experts", "2", "--hidden", "64", "--intermediate", "32", "--repeats", "1", "--skip-flashinfer"]
    try:
        assert main(["bench", "moe", *argv, "--threads", "1", "--json-out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    result = json.loads(out.read_text())
    assert (result["experts"], result["hidden"], result["threads"]) == (2, 64, 1)


def test_cpu_tables_rows_are_the_issues_and_the_families() -> None:
    from bench import cpu_table

    assert [row.name(row.params) for row in cpu_table.ROWS["issue"]] == [
        "10M, float32, 64 x 128",
        "100M, float32, 64 x 128",
        "100M, bfloat16, 64 x 128",
        "100M, bfloat16, 32 mixed prompts",
    ]
    assert [(row.arch, row.name("1M")) for row in cpu_table.ROWS["families"]] == [
        ("qwen3", "Qwen3 1M, float32, 64 x 128"),
        ("qwen3", "Qwen3 1M, bfloat16, 64 x 128"),
        ("gemma3", "Gemma 3 1M, bfloat16, 64 x 128"),
    ]
    with pytest.raises(SystemExit):
        cpu_table.parse_args(["--rows", "everything"])
