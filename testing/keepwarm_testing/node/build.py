"""Run node/build.sh (or reuse its cache) from Python; failures carry the build log's tail."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


class NodeBuildError(RuntimeError):
    """build.sh failed: the message holds the build's errors (log tail) and the log path."""


def build_node_components(timeout_s: float | None = None) -> Path:
    """Build (or reuse) containerd, runc, the CNI plugins and crictl; returns the directory holding them."""
    log = Path(tempfile.gettempdir()) / f"keepwarm-node-build-{os.getuid()}.log"
    with open(log, "w") as out:
        proc = subprocess.run(
            ["bash", str(HERE / "build.sh")], stdout=subprocess.PIPE, stderr=out, text=True, timeout=timeout_s
        )
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-60:])
        raise NodeBuildError(f"{HERE / 'build.sh'} exited {proc.returncode} (full log {log}):\n{tail}")
    return Path(proc.stdout.strip().splitlines()[-1])
