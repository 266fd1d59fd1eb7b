"""`keepwarm bench restart --drop-caches`: refused by name where the page cache cannot be dropped, and
the server's startup metrics read back into the report as the server exported them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench import restart
from keepwarm_runtime.cli import main


def test_drop_caches_is_refused_by_name_when_not_root(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["bench", "restart", "--drop-caches", "--json"]) == 2
    err = capsys.readouterr().err
    assert "keepwarm bench restart: --drop-caches needs root" in err and "uid 1000" in err


def test_drop_caches_is_refused_where_the_control_file_cannot_be_written(tmp_path: Path):
    missing = tmp_path / "drop_caches"  # e.g. a read-only /proc/sys: root cannot write it either
    assert restart.drop_caches_refusal(0, missing) == (
        f"--drop-caches: {missing} is not writable here (read-only /proc/sys?)"
    )
    assert restart.drop_caches_refusal(0, tmp_path) is None  # root and writable: allowed


def test_startup_report_reads_phases_ready_time_and_source():
    metrics = {
        'keepwarm_startup_phase_seconds{phase="imports"}': 3.25,
        'keepwarm_startup_phase_seconds{phase="weights"}': 1.5,
        'keepwarm_weight_load_seconds{source="cache"}': 0.4,
        "keepwarm_process_start_to_ready_seconds": 5.0,
    }
    assert restart.startup_report(metrics) == {
        "ready_s": 5.0,
        "phases_s": {"imports": 3.25, "weights": 1.5},
        "weights_source": "cache",
        "attach_s": 0.4,
    }


@pytest.mark.parametrize(("socket_dir", "tail"), [(None, []), (Path("/s"), ["--cache-socket-dir", "/s"])])
def test_serve_args_never_fall_back_to_disk_when_timing_the_cache(socket_dir, tail):
    settings = restart.RestartSettings(serving_dtype="bfloat16", threads=2)
    args = restart.serve_args(settings, socket_dir)
    assert args[:6] == ["--dtype", "bfloat16", "--device", "cpu", "--threads", "2"]
    assert args[6:] == ([*tail, "--no-cache-fallback"] if socket_dir else [])
