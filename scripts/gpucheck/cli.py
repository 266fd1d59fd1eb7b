"""Command lines of `scripts/gpu-check` and `scripts/gpu-prepare`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from scripts.gpucheck import manifest, plan

DEV_PYTHON = manifest.REPO / ".venv" / "bin" / "python"


def _dev_python_or_exit(argv: list[str], script: str) -> None:
    """The dry run and gpu-prepare need the dev venv (torch, packaging): re-exec under it when present."""
    if DEV_PYTHON.exists() and Path(sys.executable).absolute() != DEV_PYTHON.absolute():
        os.execv(str(DEV_PYTHON), [str(DEV_PYTHON), str(manifest.REPO / "scripts" / script), *argv])


def check_main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="gpu-check", description="Everything that needs a GPU, in one go.")
    p.add_argument("--dry-run", action="store_true", help="on a CPU machine: check carry, imports, plan")
    p.add_argument("--no-wheels", action="store_true", help="dry run without the carried archive")
    p.add_argument("--smoke", action="store_true", help="dry run: also run the benchmarks' CPU twins")
    p.add_argument("--only", default=None, help="comma-separated step names (a rerun)")
    p.add_argument("--budget", type=float, default=plan.BUDGET_S, help="seconds for all steps")
    p.add_argument("--list", action="store_true", help="print the plan and the device command, run nothing")
    a = p.parse_args(argv)
    try:
        steps = plan.select(a.only.split(",") if a.only else None)
    except ValueError as exc:
        p.error(str(exc))
    from scripts.gpucheck import dryrun

    if a.list:
        print(dryrun.describe_plan(steps))
        return 0
    if a.dry_run:
        _dev_python_or_exit(argv, "gpu-check")
        return dryrun.main(steps, wheels=not a.no_wheels, smoke=a.smoke)
    from scripts.gpucheck import runner

    return runner.main(steps, a.budget)


def prepare_main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="gpu-prepare", description="Fetch and pack what the GPU run carries.")
    p.parse_args(argv)
    _dev_python_or_exit(argv, "gpu-prepare")
    from scripts.gpucheck import prepare

    return prepare.main(argv)
