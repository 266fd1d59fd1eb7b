"""Run node/build.sh (or reuse its cache) from Python; failures carry the build log's tail."""

from __future__ import annotations

from pathlib import Path

from keepwarm_testing.controlplane.build import run_build_script

HERE = Path(__file__).resolve().parent


class NodeBuildError(RuntimeError):
    """build.sh failed: the message holds the build's errors (log tail) and the log path."""


def build_node_components(timeout_s: float | None = None) -> Path:
    """Build (or reuse) containerd, runc, the CNI plugins, crictl and the add-ons (CoreDNS, the
    LeaderWorkerSet controller and its manifests, in `lws/` beside it); returns the bin directory."""
    return run_build_script(HERE / "build.sh", "node", NodeBuildError, timeout_s)
