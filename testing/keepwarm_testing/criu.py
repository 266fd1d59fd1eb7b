"""CRIU for the snapshot tests (docs/snapshots.md): scripts/criu/build.sh's cached build, or a build now."""

from __future__ import annotations

from pathlib import Path

from keepwarm_testing.controlplane.build import run_build_script

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "scripts" / "criu" / "build.sh"


class CriuBuildError(RuntimeError):
    """build.sh failed: the message holds its log tail."""


def build_criu(timeout_s: float | None = None) -> Path:
    """The CRIU binary built by scripts/criu/build.sh (reused from its cache when present)."""
    return run_build_script(BUILD, "criu", CriuBuildError, timeout_s) / "criu"
