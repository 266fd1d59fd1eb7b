"""GPU tier hand-off and holder recovery: the VMM POSIX-fd handles travel as the memfds do.

Run with scripts/gpu-check (step tests-cache); passed on an H200 on 2026-12-04. What it finds
out is whether an exported handle's fd alone keeps the allocation alive once the daemon that
allocated it has exited (hand-off) or was killed (holder).
"""

from __future__ import annotations

import pytest
import torch

from keepwarm_runtime.cache.client import attach
from keepwarm_runtime.cache.launcher import DaemonProcess, HolderProcess

pytestmark = pytest.mark.integration


def _daemon(socket_dir, model) -> DaemonProcess:
    extra = ("--device", "cuda:0", "--dtype", "float32")
    return DaemonProcess(socket_dir, [model], *extra, tier="gpu").wait_ready()


def _same_as_disk(model, socket_dir) -> None:
    res = attach(model, socket_dir, dtype=torch.float32, device="cuda:0", fallback=False)
    disk = attach(model, None, dtype=torch.float32)
    assert res.tier == "gpu"
    for name, t in disk.tensors.items():
        assert torch.equal(res.tensors[name].cpu(), t), name


def test_gpu_arenas_survive_a_handoff_and_a_sigkill(tiny_llama, socket_dir):
    hold = HolderProcess(socket_dir).wait_ready()
    try:
        first = _daemon(socket_dir, tiny_llama)
        second = _daemon(socket_dir, tiny_llama)
        assert first.wait_exit(120) == 0
        assert "took 1 arenas from the predecessor" in second.stderr, second.stderr
        _same_as_disk(tiny_llama, socket_dir)  # the allocating daemon has exited
        second.kill()
        third = _daemon(socket_dir, tiny_llama)
        assert "took 1 arenas from the holder" in third.stderr, third.stderr
        _same_as_disk(tiny_llama, socket_dir)
        third.terminate(60)
    finally:
        hold.terminate(60)
