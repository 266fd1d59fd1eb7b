"""`scripts/gpu-check --dry-run`: on this CPU machine, prove the GPU run will start, before paying for it.

Checks, each reported as a line "ok|FAIL|skip: what": the carried archive exists, matches its pins
and sha256, and fits the device call beside the working tree; every module each step needs imports
from the archive + the repository + packages the GPU image has (others refused, see blocker.py),
with --no-deps semantics, and with the image's own transformers (manifest.LOCAL_STANDINS) in use;
each pinned module (carried or stand-in) is imported from the archive or the stand-ins, at its pin;
`keepwarm --help` builds every subcommand; each benchmark step's flags exist in its --help; pytest
collects tests/gpu; with --smoke, the CPU twins run (plan.SMOKE_STEPS) and their JSON results hold the
keys they expect (the restart twin: both `keepwarm serve` starts). Then prints the plan and the device
command. Binary modules in the archive are built for the GPU
machine's Python 3.12, so the same versions built for this interpreter stand in for them here
(.whl/local/), fetched once, as do image packages this venv lacks (manifest.LOCAL_STANDINS).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from scripts.gpucheck import blocker, manifest, plan, prepare

REPO = manifest.REPO


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    failed: bool = False

    def ok(self, what: str) -> None:
        self.lines.append(f"ok:   {what}")

    def fail(self, what: str) -> None:
        self.failed = True
        self.lines.append(f"FAIL: {what}")

    def skip(self, what: str) -> None:
        self.lines.append(f"skip: {what}")


def device_command(only: list[str] | None = None) -> str:
    """The one-line command to give the device tool (its carry list: manifest.CARRY_PATHS)."""
    tail = f" --only {','.join(only)}" if only else ""
    return f"PYTHONUNBUFFERED=1 python3 scripts/gpu-check{tail} 2>&1"


def describe_plan(steps: list[plan.Step]) -> str:
    rows = [f"plan: {len(steps)} steps; budget {plan.BUDGET_S} s (core steps' ceilings sum to "]
    rows[0] += f"{plan.core_ceiling_s(steps)} s); device call timeout_s={plan.DEVICE_TIMEOUT_S}"
    for s in steps:
        line = " ".join(s.command("python3", "$WORK"))
        rows.append(f"  {s.name:<24} {s.ceiling_s:>4} s  {'core ' if s.core else 'extra'}  {line}")
    rows.append(f"device: run(command={device_command()!r}, carry={manifest.CARRY_PATHS}, ")
    rows[-1] += f"timeout_s={plan.DEVICE_TIMEOUT_S})"
    return "\n".join(rows)


def check_archive(report: Report) -> bool:
    if not manifest.ARCHIVE.exists():
        report.fail(f"{manifest.ARCHIVE} missing: run scripts/gpu-prepare")
        return False
    if not prepare.archive_is_current():
        report.fail("the archive does not match site.json or today's pins: run scripts/gpu-prepare")
        return False
    report.ok(f"archive current ({manifest.ARCHIVE.stat().st_size / 2**20:.1f} MiB, pins as in manifest)")
    return True


def check_carry(report: Report) -> None:
    try:
        calls = prepare.carry_plan()
    except ValueError as exc:
        report.fail(str(exc))
        return
    if len(calls) != 1:
        report.fail(
            f"the carry needs {len(calls)} calls; gpu-check runs in one:\n{prepare.describe_calls(calls)}"
        )
    else:
        report.ok(prepare.describe_calls(calls))


def local_site() -> list[Path]:
    """The archive unpacked here (once per sha256), plus this interpreter's builds of its binary
    wheels and the image's versions of LOCAL_STANDINS, ahead of it on the path."""
    record = json.loads(manifest.ARCHIVE_MANIFEST.read_text())
    site = manifest.LOCAL_DIR / "site"
    stamp = site / ".sha256"
    if not (stamp.exists() and stamp.read_text() == record["sha256"]):
        subprocess.run(["rm", "-rf", str(site)], check=True)
        site.mkdir(parents=True)
        with tarfile.open(manifest.ARCHIVE, "r:xz") as tar:
            tar.extractall(site, filter="tar")
        stamp.write_text(record["sha256"])
    overlay = manifest.LOCAL_DIR / f"overlay-py{sys.version_info.major}{sys.version_info.minor}"
    for pin in [*manifest.CARRIED, *manifest.LOCAL_STANDINS]:
        shipped = prepare.wheel_for(pin, manifest.DOWNLOAD_DIR)
        if shipped is not None and shipped.name.endswith("-none-any.whl"):
            continue  # pure Python: the archive's copy runs here as it is
        if all((overlay / m).exists() or (overlay / f"{m}.py").exists() for m in pin.modules):
            continue
        own = prepare.download(pin, manifest.LOCAL_DIR / "wheels", ["--only-binary=:all:"])
        argv = [prepare.pip_python(), "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
        subprocess.run([*argv, "--upgrade", "--target", str(overlay), str(own)], check=True)
    return [overlay, site]


def carried_modules() -> set[str]:
    return {m for pin in manifest.CARRIED for m in pin.modules}


def _run(argv: list[str], env: dict[str, str], timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def check_imports(report: Report, env: dict[str, str], steps: list[plan.Step], wheels: bool) -> None:
    modules = sorted({m for s in steps for m in s.imports})
    done = _run([sys.executable, "-m", "scripts.gpucheck.probe", *modules], env)
    if done.returncode != 0:
        report.fail(f"import probe crashed:\n{done.stderr[-2000:]}")
        return
    for module, result in json.loads(done.stdout.splitlines()[-1]).items():
        if result == "ok":
            report.ok(f"import {module}")
        elif not wheels and any(f"'{m}" in result for m in carried_modules()):
            report.skip(f"import {module}: needs the carried archive (--no-wheels)")
        else:
            report.fail(f"import {module}: {result}")


VERSION_PROBE = """
import importlib, importlib.metadata, json, sys
found = {"torch": [importlib.import_module("torch").__version__, None]}
for dist, module in zip(sys.argv[1::2], sys.argv[2::2]):
    spec = importlib.import_module(module).__spec__  # a namespace package (opentelemetry): its first part
    where = spec.origin if spec.origin not in (None, "namespace") else [*spec.submodule_search_locations][0]
    found[dist] = [importlib.metadata.version(dist), where]
print(json.dumps(found))
"""


def check_versions(report: Report, env: dict[str, str], paths: list[Path]) -> None:
    """The versions the checks above imported: each pin's module must come from the archive (or the
    stand-ins' overlay), not from this venv, and its distribution must be the pinned version."""
    pins = [*manifest.LOCAL_STANDINS, *manifest.CARRIED]
    argv = [a for p in pins for a in (p.name, p.modules[0])]
    done = _run([sys.executable, "-c", VERSION_PROBE, *argv], env)
    if done.returncode != 0:
        report.fail(f"version probe: {done.stderr[-1500:]}")
        return
    found = json.loads(done.stdout)
    wrong = {p.name: found[p.name][0] for p in pins if found[p.name][0] != p.version}
    roots = [path.resolve() for path in paths]
    elsewhere = {
        p.name: found[p.name][1]
        for p in pins
        if not any(Path(found[p.name][1]).resolve().is_relative_to(root) for root in roots)
    }
    if wrong or elsewhere:
        report.fail(
            f"imported versions differ from the pins: {wrong}; imported from outside the archive: {elsewhere}"
        )
    else:
        shown = ", ".join(f"{name} {version}" for name, (version, _) in found.items())
        report.ok(
            f"versions in use, pins from the archive: {shown} "
            "(torch differs from the GPU image's 2.11: not checkable here)"
        )


def check_cli_and_flags(report: Report, env: dict[str, str], steps: list[plan.Step]) -> None:
    done = _run([sys.executable, "-m", "keepwarm_runtime.cli", "--help"], env)
    if done.returncode == 0:
        report.ok("keepwarm --help builds every subcommand")
    else:
        report.fail(f"keepwarm --help: {done.stderr.strip()[-1500:]}")
    helps: dict[tuple[str, ...], str] = {}
    for step in steps:
        if step.help_argv is None:
            continue
        key = tuple(step.help_argv)
        if key not in helps:
            out = _run([a.replace(plan.PY, sys.executable) for a in key], env)
            helps[key] = out.stdout if out.returncode == 0 else f"FAILED: {out.stderr[-1500:]}"
        missing = [f for f in step.flags() if f not in helps[key]]
        if helps[key].startswith("FAILED"):
            report.fail(f"{step.name}: {' '.join(key[1:])}: {helps[key]}")
        elif missing:
            report.fail(f"{step.name}: flags not in its --help: {', '.join(missing)}")
        else:
            report.ok(f"{step.name}: every flag is in its --help")


def check_collect(report: Report, env: dict[str, str], wheels: bool) -> None:
    argv = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/gpu"]
    done = _run(argv, env)
    last = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
    if done.returncode == 0:
        report.ok(f"pytest collects tests/gpu: {last}")
    else:
        report.fail(f"pytest --collect-only tests/gpu: {last}\n{done.stdout[-2000:]}{done.stderr[-1000:]}")


def check_smoke(report: Report, env: dict[str, str]) -> None:
    env = env | {"KEEPWARM_BENCH_DIR": str(manifest.LOCAL_DIR / "bench"), "OMP_NUM_THREADS": "1"}
    for step in plan.SMOKE_STEPS:
        try:
            done = _run(step.command(sys.executable, str(manifest.LOCAL_DIR)), env, step.ceiling_s)
        except subprocess.TimeoutExpired:
            report.fail(f"{step.name}: over {step.ceiling_s} s")
            continue
        if done.returncode != 0:
            report.fail(f"{step.name}: rc {done.returncode}\n{done.stderr[-2000:]}")
            continue
        found = expected_values(step, done.stdout)
        missing = [key for key, value in found.items() if value is None]
        if missing:
            report.fail(f"{step.name}: its JSON result lacks {', '.join(missing)}\n{done.stdout[-1500:]}")
        else:
            shown = "".join(f"; {key} = {value}" for key, value in found.items())
            report.ok(f"{step.name}: ran on CPU under the GPU image's packages{shown}")


def expected_values(step: plan.Step, stdout: str) -> dict[str, object]:
    """{dotted key: value or None} for each of step.expect in the step's JSON stdout."""
    from scripts.gpucheck.runner import parse_json

    result, found = parse_json(stdout), {}
    for key in step.expect:
        value = result
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        found[key] = value
    return found


def run(steps: list[plan.Step], wheels: bool = True, smoke: bool = False) -> Report:
    report = Report()
    paths: list[Path] = []
    if wheels:
        if check_archive(report):
            paths = local_site()
        check_carry(report)
    else:
        report.skip("archive and carry (--no-wheels): run scripts/gpu-prepare, then --dry-run")
    blocked = blocker.blocked_modules(
        manifest.image_packages(),
        manifest.carried_names() | manifest.FROM_REPO,
        manifest.KNOWN_ABSENT,
        manifest.normalize,
    )
    scratch = manifest.LOCAL_DIR / "blocker"
    env = os.environ | blocker.write_sitecustomize(scratch, blocked)
    env["PYTHONPATH"] = blocker.pythonpath(scratch, *paths, *manifest.repo_paths())
    env["PYTHONNOUSERSITE"] = "1"
    # pytest loads every installed plugin; the image has pytest-timeout (gpu-check's --timeout) but not
    # this venv's others (schemathesis, ...), whose imports the blocker would refuse.
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    env["PYTEST_PLUGINS"] = "pytest_timeout"
    if not report.failed or not wheels:
        check_imports(report, env, steps, wheels)
        if wheels:
            check_versions(report, env, paths)
        else:
            report.skip("versions (--no-wheels): this venv's transformers, not the image's")
        check_cli_and_flags(report, env, steps)
        check_collect(report, env, wheels)
        if smoke:
            check_smoke(report, env)
    return report


def main(steps: list[plan.Step], wheels: bool, smoke: bool = False) -> int:
    print(describe_plan(steps), flush=True)
    report = run(steps, wheels, smoke)
    print("\n".join(report.lines))
    print("dry run:", "FAILED" if report.failed else "ok")
    return 1 if report.failed else 0
