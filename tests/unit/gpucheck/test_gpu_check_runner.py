"""scripts/gpu-check's runner on CPU with stand-in steps: time boxes, process-group kills, the results
bundle in $OUT, junit parsing and the carried archive's unpacking."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from scripts.gpucheck import manifest, plan, runner


def _step(name: str, code: str, ceiling_s: int = 30, kind: str = "json", core: bool = True) -> plan.Step:
    return plan.Step(name, [plan.PY, "-c", code], ceiling_s, kind, core=core)


def test_run_step_records_status_and_json(tmp_path):
    env = os.environ.copy()
    ok = runner.run_step(_step("ok", "print('{\"ratio\": 21.5}')"), 30, sys.executable, tmp_path, env)
    assert ok["status"] == "passed" and ok["result"] == {"ratio": 21.5}
    bad = runner.run_step(_step("bad", "import sys; sys.exit('boom')"), 30, sys.executable, tmp_path, env)
    assert bad["status"] == "failed" and bad["rc"] == 1 and "boom" in bad["stderr_tail"]


def test_a_step_runs_with_its_own_environment_on_top(tmp_path):
    names = "'KEEPWARM_GPU_FLASHINFER_MOE', 'HOME'"
    code = f"import json, os; print(json.dumps([os.environ[k] for k in ({names})]))"
    step = plan.Step("env-step", [plan.PY, "-c", code], 30, "json", env={"KEEPWARM_GPU_FLASHINFER_MOE": "1"})
    record = runner.run_step(step, 30, sys.executable, tmp_path, os.environ | {"HOME": "/h"})
    assert record["status"] == "passed" and record["result"] == ["1", "/h"]


def test_a_step_past_its_box_is_killed_with_its_children(tmp_path):
    pid_file = tmp_path / "child.pid"
    code = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(60)\n"
    )
    started = time.monotonic()
    record = runner.run_step(_step("slow", code), 3, sys.executable, tmp_path, os.environ.copy())
    assert record["status"] == "timeout" and time.monotonic() - started < 20
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the grandchild was in the killed process group
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"grandchild {child} survived the step's time box")


def test_main_bundles_results_and_skips_steps_the_budget_cannot_hold(tmp_path, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setenv("OUT", str(out))
    monkeypatch.setattr(manifest, "ARCHIVE", tmp_path / "absent.tar.xz")
    monkeypatch.setattr(manifest, "SITE_ON_DEVICE", str(tmp_path / "site"))
    steps = [
        _step("restart-1gib-bf16", 'print(\'{"ratio": 3.0, "warm_attach_s": 0.1}\')', 5),
        _step("fails", "raise SystemExit(3)", 5),
        _step("too-long-for-what-is-left", "print(1)", 100, core=False),
    ]
    rc = runner.main(steps, budget_s=20)
    assert rc == 1  # a step failed
    assert sorted(p.name for p in out.iterdir()) == [runner.BUNDLE, runner.SUMMARY]  # device returns ≤ 8
    summary = json.loads((out / runner.SUMMARY).read_text())
    assert summary["steps"]["restart-1gib-bf16"]["status"] == "passed"
    assert summary["steps"]["fails"]["status"] == "failed"
    assert summary["steps"]["too-long-for-what-is-left"] == {"status": "skipped", "why": "budget spent"}
    assert summary["headline"]["restart-1gib-bf16"]["ratio"] == 3.0
    assert "flashinfer steps will fail" in summary["install"]
    with tarfile.open(out / runner.BUNDLE) as tar:
        names = tar.getnames()
    assert "gpu-check/fails.err" in names and "gpu-check/summary.json" in names


def test_parse_junit_reads_outcomes_and_properties(tmp_path):
    (tmp_path / "test_demo.py").write_text(
        "import pytest\n"
        "def test_pass(record_property):\n    record_property('read_only_mapping', 'refused')\n"
        "def test_fail():\n    assert 1 == 2\n"
        "def test_skip():\n    pytest.skip('no flashinfer')\n"
        "def test_xfail():\n    pytest.xfail('driver gave read-write')\n"
    )
    xml = tmp_path / "junit.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", "test_demo.py"],
        cwd=tmp_path,
        capture_output=True,
    )
    parsed = runner.parse_junit(xml)
    assert parsed["counts"] == {"passed": 1, "failed": 1, "skipped": 1, "xfailed": 1}
    cases = {k.rsplit("::", 1)[1]: v for k, v in parsed["cases"].items()}
    assert cases["test_pass"]["properties"] == {"read_only_mapping": "refused"}
    assert "no flashinfer" in cases["test_skip"]["message"]
    assert runner.parse_junit(tmp_path / "missing.xml") == {"error": "missing.xml not written"}


def _archive(tmp_path: Path) -> tuple[Path, Path]:
    archive, record = tmp_path / "site.tar.xz", tmp_path / "site.json"
    with tarfile.open(archive, "w:xz") as tar:
        data = b"VERSION = '9'\n"
        info = tarfile.TarInfo("demo_pkg/__init__.py")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    import hashlib

    record.write_text(json.dumps({"sha256": hashlib.sha256(archive.read_bytes()).hexdigest()}))
    return archive, record


def test_unpack_site_once_per_archive_and_refuses_a_corrupt_one(tmp_path):
    archive, record = _archive(tmp_path)
    dest = tmp_path / "site"
    assert runner.unpack_site(archive, record, dest).startswith("unpacked")
    assert (dest / "demo_pkg" / "__init__.py").read_text() == "VERSION = '9'\n"
    assert runner.unpack_site(archive, record, dest) == f"reused {dest}"
    archive.write_bytes(archive.read_bytes()[:-8] + b"corrupt!")
    (dest / ".sha256").unlink()
    with pytest.raises(SystemExit, match="carry it again"):
        runner.unpack_site(archive, record, dest)


def test_headline_puts_flashinfer_and_torch_backends_side_by_side():
    steps = {
        "throughput-flashinfer": {"result": {"keepwarm": {"tokens_per_s": 3000.0}, "speedup": 2.0}},
        "throughput-torch": {"result": {"keepwarm": {"tokens_per_s": 1500.0}}},
        "env": {"result": {"gpu": "H200"}},
    }
    figures = runner.headline(steps)
    assert figures["flashinfer_over_torch_backend"] == 2.0
    assert figures["throughput-flashinfer"]["speedup"] == 2.0
    assert "env" not in figures


def test_a_pytest_step_that_collects_nothing_is_empty_not_failed(tmp_path):
    step = _step("tests-gpu-other", "raise SystemExit(5)", kind="pytest")
    record = runner.run_step(step, 30, sys.executable, tmp_path, os.environ.copy())
    assert record["status"] == "empty"
    assert record["tests"] == {"error": "tests-gpu-other.xml not written"}


def test_a_failed_gate_step_stops_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.setattr(manifest, "ARCHIVE", tmp_path / "absent.tar.xz")
    monkeypatch.setattr(manifest, "SITE_ON_DEVICE", str(tmp_path / "site"))
    gate = plan.Step("env", [plan.PY, "-c", "raise SystemExit(2)"], 10, "json", gate=True)
    assert runner.main([gate, _step("after", "print(1)", 5)], budget_s=30) == 1
    summary = json.loads((tmp_path / "out" / runner.SUMMARY).read_text())
    assert summary["steps"]["after"] == {"status": "skipped", "why": "env failed"}


def test_headline_shows_the_server_starts_of_a_serve_restart():
    serve = {"disk_warm": {"ready_s": 9.5, "wall_to_ready_s": 11.0}, "cache": {"ready_s": 6.25}}
    steps = {"restart-1gib-bf16-serve": {"result": {"ratio": 3.0, "serve": serve}}}
    figures = runner.headline(steps)["restart-1gib-bf16-serve"]
    assert figures["ratio"] == 3.0 and figures["serve_ready_s"] == {"disk_warm": 9.5, "cache": 6.25}
    assert (
        "serve_ready_s"
        not in runner.headline({"restart-1gib-bf16": {"result": {"ratio": 3.0}}})["restart-1gib-bf16"]
    )
