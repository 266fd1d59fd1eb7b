"""bench/audio.py runs at toy size and prints the fields the issue asks for (numbers are not checked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_audio_bench_reports_each_backend_and_the_ratio(tmp_path: Path) -> None:
    out = tmp_path / "audio.json"
    argv = [sys.executable, "bench/audio.py", "--seconds", "1", "--requests", "2", "--concurrency", "1", "2"]
    proc = subprocess.run(
        [*argv, "--json-out", str(out)],
        cwd=REPO,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert json.loads(proc.stdout) == report
    assert set(report["throughput"]) == {"torchcodec", "soundfile", "pyav"}
    for backend in report["throughput"].values():
        assert set(backend) == {"1", "2"}
        assert all(level["audio_s_per_wall_s"] > 0 and level["audio_s"] >= 2.0 for level in backend.values())
    assert set(report["torchcodec_over_pyav"]) == {"1", "2"}
