"""`scripts/gpu-check` on the GPU machine: unpack the carried packages, run the steps, bundle the results.

Results go to $OUT (default /tmp/keepwarm-gpu-check), two files, rewritten after every step so a run
cut short still returns what it measured: ``summary.json`` (machine, each step's status, seconds, its
JSON result or test outcomes, and the headline ratios) and ``gpu-check.tar.gz`` (every step's stdout,
stderr and junit XML). The device tool returns at most 8 files; this keeps it at 2.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from scripts.gpucheck import manifest, plan

SUMMARY = "summary.json"
BUNDLE = "gpu-check.tar.gz"
PYTEST_NO_TESTS = 5  # pytest's exit code when it collected nothing
BENCH_DIR_MIN_FREE = 40 << 30  # checkpoints of 1, 4 and 16 GiB, with room to spare
# How a step past its box is stopped: each signal, then how long it may take to exit.
STOP_SIGNALS = ((signal.SIGINT, 6.0), (signal.SIGABRT, 3.0), (signal.SIGKILL, 10.0))


def unpack_site(archive: Path, record: Path, dest: Path) -> str:
    """Unpack the carried archive once per sha256 (a rerun on a warm machine reuses it); returns a note."""
    if not archive.exists():
        return f"no {archive.name}: flashinfer steps will fail (run scripts/gpu-prepare, carry .whl/gpu)"
    expected = json.loads(record.read_text())["sha256"]
    stamp = dest / ".sha256"
    if stamp.exists() and stamp.read_text() == expected:
        return f"reused {dest}"
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    if digest != expected:
        raise SystemExit(f"gpu-check: {archive} sha256 {digest} != site.json {expected}: carry it again")
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    started = time.perf_counter()
    with tarfile.open(archive, "r:xz") as tar:
        tar.extractall(dest, filter="tar")
    stamp.write_text(expected)
    return f"unpacked {archive.name} into {dest} in {time.perf_counter() - started:.1f} s"


def bench_dir() -> Path:
    """Where the restart benchmark writes checkpoints: RAM-backed /dev/shm when it has room."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free >= BENCH_DIR_MIN_FREE:
        return shm / "keepwarm-bench"
    return Path(tempfile.gettempdir()) / "keepwarm-bench"


def step_env(site: Path | None) -> dict[str, str]:
    paths = [*([str(site)] if site else []), *map(str, manifest.repo_paths())]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    return os.environ | {
        "PYTHONPATH": os.pathsep.join(paths),
        "PYTHONUNBUFFERED": "1",
        "PYTHONFAULTHANDLER": "1",  # SIGABRT at the box dumps every thread's stack (stop_group)
        "KEEPWARM_BENCH_DIR": str(bench_dir()),
        # flashinfer JIT-compiles kernels on first use; one cache for every step of the run
        "FLASHINFER_WORKSPACE_BASE": str(Path(tempfile.gettempdir()) / "keepwarm-flashinfer"),
    }


def run_step(step: plan.Step, box_s: float, py: str, work: Path, env: dict[str, str]) -> dict:
    """Run one step in its own process group (killed whole at its time box); returns its record."""
    out, err = work / f"{step.name}.out", work / f"{step.name}.err"
    started = time.perf_counter()
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen(
            step.command(py, str(work)),
            cwd=manifest.REPO,
            env=env | step.env,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=box_s)
            status = "passed" if rc == 0 else "failed"
            if step.kind == "pytest" and rc == PYTEST_NO_TESTS:
                status = "empty"
        except subprocess.TimeoutExpired:
            rc = stop_group(proc)
            status = "timeout"
    record = {"status": status, "rc": rc, "seconds": round(time.perf_counter() - started, 1)}
    record["box_s"] = round(box_s)
    if step.kind == "json":
        record["result"] = parse_json(out.read_text())
    elif step.kind == "pytest":
        record["tests"] = parse_junit(work / f"{step.name}.xml")
    if status != "passed":
        record["stderr_tail"] = err.read_text()[-2500:]
        record["stdout_tail"] = out.read_text()[-1500:]
    return record


def stop_group(proc: subprocess.Popen) -> int:
    """Stop a step past its box so that it says where it was: SIGINT first (pytest writes its junit
    XML and summary, Python prints a KeyboardInterrupt traceback), then SIGABRT (faulthandler dumps
    every thread's stack), then SIGKILL."""
    for sig, grace_s in STOP_SIGNALS:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            return proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            continue
    return proc.wait()


def parse_json(text: str):
    """The step's stdout as JSON: the whole text, else its last line, else None."""
    for candidate in (text, (text.strip().splitlines() or [""])[-1]):
        try:
            return json.loads(candidate)
        except ValueError:
            continue
    return None


def parse_junit(path: Path) -> dict:
    """Outcome per test ({"passed", "failed", "error", "skipped", "xfailed"} + message) and properties."""
    if not path.exists():
        return {"error": f"{path.name} not written"}
    cases = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        entry: dict = {"outcome": "passed", "seconds": float(case.get("time") or 0)}
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                kind = node.get("type") or ""
                entry["outcome"] = "xfailed" if "xfail" in kind else {"failure": "failed"}.get(tag, tag)
                entry["message"] = (node.get("message") or "")[:800]
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        if props:
            entry["properties"] = props
        cases[name] = entry
    counts: dict[str, int] = {}
    for entry in cases.values():
        counts[entry["outcome"]] = counts.get(entry["outcome"], 0) + 1
    return {"counts": counts, "cases": cases}


def headline(steps: dict[str, dict]) -> dict:
    """The figures the issue asks for side by side, from this run only."""
    figures: dict = {}
    for name, record in steps.items():
        result = record.get("result")
        if not isinstance(result, dict):
            continue
        if name.startswith("restart-"):
            figures[name] = {
                k: result.get(k) for k in ("hf_from_pretrained_s", "warm_attach_s", "ratio", "ratio_ceiling")
            }
            if isinstance(result.get("serve"), dict):  # whole `keepwarm serve` starts, by weight source
                figures[name]["serve_ready_s"] = {
                    case: r.get("ready_s") for case, r in result["serve"].items()
                }
        elif name.startswith("throughput-"):
            figures[name] = {
                "keepwarm_tokens_per_s": result.get("keepwarm", {}).get("tokens_per_s"),
                "hf_generate_tokens_per_s": result.get("hf_generate", {}).get("tokens_per_s"),
                "speedup": result.get("speedup"),
                "attention_backend": result.get("keepwarm", {}).get("attention_backend"),
            }
    fi, tb = figures.get("throughput-flashinfer"), figures.get("throughput-torch")
    if fi and tb and fi["keepwarm_tokens_per_s"] and tb["keepwarm_tokens_per_s"]:
        figures["flashinfer_over_torch_backend"] = round(
            fi["keepwarm_tokens_per_s"] / tb["keepwarm_tokens_per_s"], 2
        )
    return figures


def write_results(out: Path, work: Path, summary: dict) -> None:
    summary["headline"] = headline(summary["steps"])
    (work / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
    shutil.copy(work / SUMMARY, out / SUMMARY)
    with tarfile.open(out / (BUNDLE + ".partial"), "w:gz") as tar:
        tar.add(work, arcname="gpu-check")
    (out / (BUNDLE + ".partial")).rename(out / BUNDLE)


def main(steps: list[plan.Step], budget_s: float = plan.BUDGET_S) -> int:
    out = Path(os.environ.get("OUT") or Path(tempfile.gettempdir()) / "keepwarm-gpu-check")
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="keepwarm-gpu-check-"))
    py = os.environ.get("PY") or sys.executable
    site = Path(manifest.SITE_ON_DEVICE)
    note = unpack_site(manifest.ARCHIVE, manifest.ARCHIVE_MANIFEST, site)
    print(f"gpu-check: {note}", flush=True)
    env = step_env(site if (site / ".sha256").exists() else None)
    summary: dict = {"python": py, "install": note, "budget_s": budget_s, "steps": {}}
    deadline = time.monotonic() + budget_s
    stopped = None  # the gate step that failed, if any
    for step in steps:
        box = plan.time_box(step, deadline - time.monotonic())
        if box is None or stopped:
            why = f"{stopped} failed" if stopped else "budget spent"
            summary["steps"][step.name] = {"status": "skipped", "why": why}
            print(f"gpu-check: {step.name}: skipped ({why})", flush=True)
            continue
        print(f"gpu-check: {step.name} (box {box:.0f} s) ...", flush=True)
        record = run_step(step, box, py, work, env)
        summary["steps"][step.name] = record
        print(f"gpu-check: {step.name}: {record['status']} in {record['seconds']} s", flush=True)
        if step.gate and record["status"] != "passed":
            stopped = step.name
        write_results(out, work, summary)
    write_results(out, work, summary)
    print(json.dumps(summary["headline"], indent=1))
    failed = [n for n, r in summary["steps"].items() if r["status"] not in ("passed", "skipped", "empty")]
    print(f"gpu-check: {'FAILED: ' + ', '.join(failed) if failed else 'all run steps passed'}")
    return 1 if failed else 0
