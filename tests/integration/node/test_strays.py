"""What a killed test cluster leaves running is found by its executable and stopped before the next
cluster starts (node/strays.py); a process that is not a node component is left alone."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from keepwarm_testing.node import strays


@pytest.mark.parametrize("component", ["containerd", "coredns", "lws-manager"])
def test_a_left_component_is_found_and_stopped_and_other_processes_are_not(
    component: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    (cache / "node" / "bin").mkdir(parents=True)
    stray_exe = cache / "node" / "bin" / component  # a stand-in binary under the cache, named as one
    shutil.copy(shutil.which("sleep"), stray_exe)
    bystander_exe = tmp_path / component  # the same name outside the cache: someone else's
    shutil.copy(shutil.which("sleep"), bystander_exe)
    monkeypatch.setattr(strays, "CACHE", cache)
    left = subprocess.Popen([str(stray_exe), "300"])
    other = subprocess.Popen([str(bystander_exe), "300"])
    try:
        assert (left.pid, component) in strays.stray_components()
        assert all(pid != other.pid for pid, _ in strays.stray_components())
        strays._kill_and_wait({pid for pid, _ in strays.stray_components() if pid == left.pid})
        assert left.wait(timeout=10) == -9
        assert other.poll() is None
    finally:
        for proc in (left, other):
            proc.kill()
            proc.wait()
