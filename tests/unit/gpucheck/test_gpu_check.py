"""scripts/gpu-check and gpu-prepare on CPU: the plan, the carry sizes, requirement checks, the blocker
that makes this venv import like the GPU machine, and the dry run itself."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from scripts.gpucheck import blocker, carry, dryrun, manifest, plan, prepare

REPO = Path(__file__).resolve().parents[3]


# -- plan --------------------------------------------------------------------------------------


def test_core_steps_fit_the_budget_and_the_device_call():
    assert plan.core_ceiling_s(plan.STEPS) <= plan.BUDGET_S
    assert plan.BUDGET_S < plan.DEVICE_TIMEOUT_S <= 600  # one device command runs at most 10 minutes
    names = [s.name for s in plan.STEPS]
    assert len(names) == len(set(names))
    for needed in ("tests-cache", "tests-engine-torch", "tests-flashinfer", "restart-16gib-bf16"):
        assert needed in names


def test_flashinfer_moe_kernels_and_their_parity_tests_are_steps():
    """bench/moe.py with FlashInfer (tokens/s and each kernel's error vs the torch reference) and the
    tests/gpu/moe parity cases, with the opt-in that test module reads set for that step only."""
    import tests.gpu.moe.test_moe_gpu as moe_tests

    steps = {s.name: s for s in plan.STEPS}
    bench = steps["moe-layer-flashinfer"]
    assert "bench/moe.py" in bench.argv and "--skip-flashinfer" not in bench.argv
    parity = steps["tests-flashinfer-moe"]
    assert parity.kind == "pytest" and "tests/gpu/moe" in parity.argv and "flashinfer" in parity.argv
    assert parity.env == {moe_tests.RUN_FLASHINFER_MOE: "1"}
    assert not any(s.env for s in plan.STEPS if s is not parity)  # other steps keep the opt-in off
    assert [s.name for s in plan.STEPS].index("moe-layer-flashinfer") < plan.STEPS.index(parity)


def test_select_keeps_plan_order_and_refuses_unknown_names():
    assert [s.name for s in plan.select(["restart-1gib-f32", "env"])] == ["env", "restart-1gib-f32"]
    with pytest.raises(ValueError, match="restart-2gib"):
        plan.select(["restart-2gib"])


def test_time_box_shrinks_to_what_is_left_and_skips_under_half():
    step = plan.STEPS[0]
    assert plan.time_box(step, 10_000) == step.ceiling_s
    assert plan.time_box(step, step.ceiling_s * 0.75) == step.ceiling_s * 0.75
    assert plan.time_box(step, step.ceiling_s * 0.4) is None


def test_device_command_and_carry_are_printed():
    text = dryrun.describe_plan(plan.STEPS)
    assert "scripts/gpu-check" in text and str(manifest.CARRY_PATHS) in text
    assert f"timeout_s={plan.DEVICE_TIMEOUT_S}" in text


# -- carry -------------------------------------------------------------------------------------


def test_plan_calls_packs_paths_into_as_few_calls_as_fit():
    mib = 1 << 20
    one = carry.plan_calls(2 * mib, {"a": 30 * mib, "b": 20 * mib}, 64 * mib)
    assert [c.carry for c in one] == [["a", "b"]] and one[0].total_bytes == 52 * mib
    two = carry.plan_calls(2 * mib, {"a": 40 * mib, "b": 30 * mib}, 64 * mib)
    assert [c.carry for c in two] == [["a"], ["b"]]
    assert all(c.total_bytes <= 64 * mib for c in two)
    with pytest.raises(ValueError, match="split it"):
        carry.plan_calls(2 * mib, {"big": 63 * mib}, 64 * mib)


def test_tree_bytes_counts_tracked_and_untracked_but_not_ignored(tmp_path):
    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / ".gitignore").write_text("ignored/\n")
    (tmp_path / "tracked").write_bytes(b"x" * 1000)
    git("add", ".gitignore", "tracked")
    (tmp_path / "untracked").write_bytes(b"y" * 300)
    (tmp_path / "ignored").mkdir()
    (tmp_path / "ignored" / "big").write_bytes(b"z" * 100_000)
    assert carry.tree_bytes(tmp_path) == 1000 + 300 + len("ignored/\n")
    assert carry.path_bytes(tmp_path / "ignored") == 100_000


# -- requirements of carried wheels --------------------------------------------------------------


def _wheel(path: Path, requires: list[str]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        meta = "Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n"
        meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
        z.writestr("demo-1.0.dist-info/METADATA", meta)
    return path


def test_unresolved_requirements_honour_markers_and_extras(tmp_path):
    wheel = _wheel(
        tmp_path / "demo-1.0-py3-none-any.whl",
        [
            "torch",
            "tvm-ffi-thing>=0.1",
            "only-on-windows; sys_platform == 'win32'",
            "old-python-shim; python_version < '3.10'",
            "extra-only; extra == 'gpu'",
            "Needed_Here>=2",
        ],
    )
    reqs = prepare.requirements(wheel)
    assert len(reqs) == 6
    assert prepare.unresolved(reqs, {"torch", "tvm-ffi-thing"}) == ["Needed_Here>=2"]


def test_manifest_never_carries_what_the_image_has():
    """Each package is the image's, carried, or left behind, in exactly one place, except a carried copy
    that deliberately shadows the image's (Pin.shadows_image) for a version a requirement needs."""
    image, carried, left = manifest.image_packages(), manifest.carried_names(), set(manifest.NOT_CARRIED)
    assert carried & image == manifest.shadowing_names()
    assert not left & image and not left & carried
    assert {"torch", "transformers", "prometheus-client", "pytest"} <= image
    assert not manifest.KNOWN_ABSENT & image
    assert all(manifest.normalize(n) == n for n in image | carried | left | manifest.KNOWN_ABSENT)
    for pin in manifest.CARRIED:
        assert pin.why and pin.modules and pin.version
        if pin.shadows_image:
            assert "image" in pin.why and ">=" in pin.why  # says which requirement forces the copy
    assert len(carried) == len(manifest.CARRIED)  # one of each


def test_the_web_stack_of_keepwarm_serve_is_carried():
    """bench restart's serve cases start `keepwarm serve` there: fastapi and what it imports at this
    venv's versions (the second GPU run died on 'No module named fastapi')."""
    from importlib.metadata import version

    carried = {manifest.normalize(p.name): p for p in manifest.CARRIED}
    for name in ("fastapi", "starlette", "uvicorn", "pydantic", "pydantic-core", "opentelemetry-api"):
        assert carried[name].version == version(name), name
    assert carried["typing-extensions"].shadows_image
    assert {"fastapi", "starlette", "uvicorn", "pydantic"} <= manifest.KNOWN_ABSENT  # seen absent there


# -- blocker: this venv importing like the GPU machine ----------------------------------------


def _blocked_env(tmp_path: Path, blocked: dict[str, str]) -> dict[str, str]:
    import os

    env = os.environ | blocker.write_sitecustomize(tmp_path / "site", blocked)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site"), str(REPO / "runtime"), str(REPO)])
    return env


def test_blocked_package_fails_to_import_in_every_child_process(tmp_path):
    env = _blocked_env(tmp_path, {"pydantic": "pydantic"})
    code = (
        "import subprocess, sys\n"
        "try:\n    import pydantic\nexcept ModuleNotFoundError as e:\n    print('parent:', e)\n"
        "subprocess.run([sys.executable, '-c', 'import keepwarm_runtime.server.base.protocol'])\n"
        "import json, keepwarm_runtime.cache.protocol\nprint('allowed ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "parent: No module named 'pydantic' (pydantic is not on the GPU machine)" in done.stdout
    assert "No module named 'pydantic'" in done.stderr  # the child, through sitecustomize
    assert "allowed ok" in done.stdout


def test_block_list_refuses_what_the_gpu_image_lacks_and_keeps_what_it_has():
    image_only = blocker.blocked_modules(
        manifest.image_packages(), manifest.FROM_REPO, manifest.KNOWN_ABSENT, manifest.normalize
    )
    assert {"pydantic", "fastapi", "uvicorn", "kopf", "keepwarm_operator"} <= set(image_only)
    blocked = blocker.blocked_modules(
        manifest.image_packages(),
        manifest.carried_names() | manifest.FROM_REPO,
        manifest.KNOWN_ABSENT,
        manifest.normalize,
    )
    assert {"kopf", "keepwarm_operator", "python_multipart"} <= set(blocked)
    assert not {"torch", "transformers", "safetensors", "numpy", "keepwarm_runtime", "_pytest"} & set(blocked)
    # carried, though seen absent on the GPU machine: the archive's copy is what the run imports
    assert not {"pydantic", "pydantic_core", "fastapi", "starlette", "uvicorn", "opentelemetry"} & set(
        blocked
    )


# -- dry run ---------------------------------------------------------------------------------------


@pytest.mark.integration
def test_dry_run_passes_on_this_checkout_without_the_archive():
    done = subprocess.run(
        [sys.executable, "scripts/gpu-check", "--dry-run", "--no-wheels"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "ok:   import keepwarm_runtime.cache.backends.cuda" in done.stdout
    assert "ok:   pytest collects tests/gpu" in done.stdout
    assert "skip: import flashinfer: needs the carried archive" in done.stdout


@pytest.mark.integration
def test_dry_run_fails_on_a_step_that_imports_what_the_gpu_lacks():
    """python-multipart (audio uploads) is neither in the image nor carried; the server's modules are."""
    imports = ["python_multipart", *plan.SERVER_MODULES]
    report = dryrun.run([plan.Step("serve", ["{py}", "-c", "pass"], 10, "text", imports)], wheels=False)
    assert report.failed
    assert any(
        line.startswith("FAIL: import python_multipart") and "python-multipart is not on the GPU" in line
        for line in report.lines
    ), report.lines
    for module in plan.SERVER_MODULES:
        assert f"ok:   import {module}" in report.lines, report.lines


def test_serve_restart_step_starts_servers_and_imports_the_web_stack():
    steps = {s.name: s for s in plan.STEPS}
    serve = steps["restart-1gib-bf16-serve"]
    assert "--no-serve" not in serve.argv and not serve.core
    assert set(plan.SERVER_MODULES) <= set(serve.imports)
    assert {"keepwarm_runtime.server.app", "keepwarm_runtime.server.base.errors", "uvicorn"} <= set(
        serve.imports
    )
    assert all(
        "--no-serve" in s.argv for n, s in steps.items() if n.startswith("restart-") and s is not serve
    )
    names = [s.name for s in plan.STEPS]
    assert names.index("restart-1gib-bf16-serve") == names.index("restart-1gib-bf16") + 1  # beside its twin
    assert plan.select(["restart-1gib-bf16-serve"]) == [serve]


def test_missing_archive_fails_the_dry_run_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(manifest, "ARCHIVE", tmp_path / "site.tar.xz")
    report = dryrun.Report()
    assert dryrun.check_archive(report) is False
    assert report.failed and "run scripts/gpu-prepare" in report.lines[0]


def test_gpu_check_refuses_an_unknown_step():
    done = subprocess.run(
        [sys.executable, "scripts/gpu-check", "--only", "nope"], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 2 and "unknown step(s) nope" in done.stderr


def test_archive_record_round_trip(tmp_path, monkeypatch):
    monkeypatch.setattr(manifest, "ARCHIVE", tmp_path / "site.tar.xz")
    monkeypatch.setattr(manifest, "ARCHIVE_MANIFEST", tmp_path / "site.json")
    manifest.ARCHIVE.write_bytes(b"archive bytes")
    record = {"pins": prepare.pins_record(), "sha256": prepare.sha256(manifest.ARCHIVE)}
    manifest.ARCHIVE_MANIFEST.write_text(json.dumps(record))
    assert prepare.archive_is_current()
    manifest.ARCHIVE.write_bytes(b"other bytes")
    assert not prepare.archive_is_current()


def test_smoke_restart_twin_must_show_both_server_starts():
    step = next(s for s in plan.SMOKE_STEPS if s.name == "smoke-restart-cpu")
    assert "--no-serve" not in step.argv
    good = {
        "serve": {
            "disk_warm": {"wall_to_ready_s": 4.1},
            "cache": {"wall_to_ready_s": 3.2, "weights_source": "cache"},
        }
    }
    assert all(v is not None for v in dryrun.expected_values(step, json.dumps(good)).values())
    found = dryrun.expected_values(step, "log line\n" + json.dumps({"warm_attach_s": 0.3}))
    assert found == dict.fromkeys(step.expect)  # --no-serve's result: every server key missing


def test_env_step_reports_carried_versions_and_unmet_requirements(monkeypatch):
    from scripts.gpucheck import envinfo

    monkeypatch.setattr(
        manifest,
        "CARRIED",
        [
            manifest.Pin("fastapi", "0", ("fastapi",), "demo"),
            manifest.Pin("no-such-dist-here", "1", ("nope",), "demo"),
        ],
    )
    found = envinfo.carried_requirements()
    assert found["versions"]["no-such-dist-here"] is None
    assert found["versions"]["fastapi"] and found["unmet"] == []  # this venv meets fastapi's needs


def test_the_decode_step_benchmark_runs_on_the_gpu_with_a_cpu_twin():
    """bench/step.py (issue 35): the host/device split of a decode step on the GPU, and its smoke twin."""
    from bench import step

    steps = {s.name: s for s in plan.STEPS}
    gpu = steps["step-decode-flashinfer"]
    assert gpu.argv[1] == "bench/step.py" and "cuda:0" in gpu.argv and "flashinfer" in gpu.argv
    args = step.parse_args(gpu.command("python", "/tmp")[2:])  # the flags the step passes parse
    assert args.params == ["10M", "100M"] and args.batches == list(step.BATCHES)
    twin = next(s for s in plan.SMOKE_STEPS if s.name == "smoke-step-cpu")
    assert twin.argv[1] == "bench/step.py" and twin.kind == "json" and "cpu" in twin.argv
