"""`keepwarm cache serve --all-gpus` on real GPUs: discovery through the CUDA driver agrees with
nvidia-smi, one daemon per GPU on gpu-<UUID>.sock, and a pod's client on each GPU attaches its own.

Run with scripts/gpu-check on a CUDA machine (step tests-cache); passed on an H200 on 2026-12-04.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time

import pytest
import torch

from keepwarm_runtime.cache.client import attach
from keepwarm_runtime.cache.gpus import discover
from keepwarm_runtime.cache.launcher import READY_PREFIX, DaemonProcess

pytestmark = pytest.mark.integration


def test_discovery_matches_nvidia_smi():
    gpus = discover()
    assert [g.ordinal for g in gpus] == list(range(torch.cuda.device_count()))
    if shutil.which("nvidia-smi") is None:
        pytest.skip("no nvidia-smi to compare with")
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True).stdout
    smi = re.findall(r"\(UUID: (GPU-[0-9a-f-]+)\)", listed)
    assert {g.uuid for g in gpus} <= set(smi)  # CUDA_VISIBLE_DEVICES may hide some


def test_one_daemon_per_gpu_each_attached_by_its_gpu(tiny_llama, socket_dir):
    daemon = DaemonProcess(socket_dir, [tiny_llama], "--all-gpus", "--dtype", "float32", tier="gpu")
    try:
        daemon.wait_ready()
        gpus = discover()
        deadline = time.monotonic() + 120
        while sum(line.startswith(READY_PREFIX) for line in daemon.lines) < len(gpus):  # one per daemon
            assert time.monotonic() < deadline and daemon.proc.poll() is None, daemon.stderr
            time.sleep(0.1)
        for g in gpus:
            res = attach(
                tiny_llama, socket_dir, dtype=torch.float32, device=f"cuda:{g.ordinal}", fallback=False
            )
            assert (res.source, res.tier, res.gpu_uuid) == ("cache", "gpu", g.uuid)
    finally:
        daemon.terminate(60)
