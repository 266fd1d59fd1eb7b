"""CRIU for the snapshot tests (docs/snapshots.md): scripts/criu/build.sh's cached build, or a build now."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "scripts" / "criu" / "build.sh"


class CriuBuildError(RuntimeError):
    """build.sh failed: the message holds its log tail."""


def build_criu(timeout_s: float | None = None) -> Path:
    """The CRIU binary built by scripts/criu/build.sh (reused from its cache when present)."""
    log = Path(tempfile.gettempdir()) / f"keepwarm-criu-build-{os.getuid()}.log"
    with open(log, "w") as out:
        proc = subprocess.run(
            ["bash", str(BUILD)], stdout=subprocess.PIPE, stderr=out, text=True, timeout=timeout_s
        )
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise CriuBuildError(f"{BUILD} exited {proc.returncode} (full log {log}):\n{tail}")
    return Path(proc.stdout.strip().splitlines()[-1]) / "criu"
