"""What the node's long-running components (containerd, the kubelet, kube-proxy) share: the last
lines of their log, and stopping one (SIGTERM, then SIGKILL after a grace period)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def log_tail(log: Path, lines: int) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def stop(proc: subprocess.Popen | None, grace_s: float) -> None:
    """Terminate `proc` if it runs, and kill it if it is still there after `grace_s`."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
