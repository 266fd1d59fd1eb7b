"""Run build.sh (or reuse its cache) from Python; failures carry the build log's tail."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


class ControlPlaneBuildError(RuntimeError):
    """build.sh failed: the message holds the exact compiler/module errors (log tail) and the log path."""


def run_build_script(
    script: Path, log_name: str, error: type[RuntimeError], timeout_s: float | None = None
) -> Path:
    """Run a cached build script (its last stdout line names what it built); a failure raises `error`
    with the log's tail and the log's path."""
    log = Path(tempfile.gettempdir()) / f"keepwarm-{log_name}-build-{os.getuid()}.log"
    with open(log, "w") as out:
        proc = subprocess.run(
            ["bash", str(script)], stdout=subprocess.PIPE, stderr=out, text=True, timeout=timeout_s
        )
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-60:])
        raise error(f"{script} exited {proc.returncode} (full log {log}):\n{tail}")
    return Path(proc.stdout.strip().splitlines()[-1])


def build_control_plane(timeout_s: float | None = None) -> Path:
    """Build (or reuse) the pinned control plane binaries; returns the directory holding them."""
    return run_build_script(HERE / "build.sh", "controlplane", ControlPlaneBuildError, timeout_s)
