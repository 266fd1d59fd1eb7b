"""Snapshots on CUDA (the CPU twins: tests/integration/snapshot). Untested on a GPU until a run of
scripts/gpu-check (step tests-snapshot): a parent that will serve on CUDA preloads FlashInfer's backend
and stays one thread without a CUDA context; a pod restored from a snapshot serves on CUDA the tokens
an importing pod serves."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from keepwarm_runtime.cache.launcher import DaemonProcess
from keepwarm_runtime.server.launcher import POD, start_server, stop_pod

PRELOAD = r"""
import sys, torch
from keepwarm_runtime.model_kind import detect_kind
from keepwarm_runtime.server.preload import preload
from keepwarm_runtime.server.supervisor import fork_hazards
preload(sys.argv[1], detect_kind(sys.argv[1]), cuda=True)
print("HAZARDS", fork_hazards(), "flashinfer" in sys.modules, torch.cuda.is_initialized())
"""


def test_a_cuda_parent_preloads_flashinfer_and_stays_one_thread_without_a_cuda_context(
    tiny_llama: Path,
) -> None:
    out = subprocess.run(
        [sys.executable, "-c", PRELOAD, str(tiny_llama)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "HAZARDS [] True False" in out.stdout, out.stdout + out.stderr[-2000:]


@pytest.mark.skipif(os.geteuid() != 0, reason="snapshots are restored in a pod's namespaces: root only")
def test_a_pod_restored_from_a_snapshot_serves_on_cuda_the_tokens_an_importing_pod_serves(
    tmp_path: Path, tiny_llama: Path
) -> None:
    criu = shutil.which("criu")  # the GPU machine has no build tools: the runtime image's criu
    if criu is None:
        pytest.skip("no criu on PATH (the runtime image installs /usr/local/sbin/criu)")
    store, sockets = tmp_path / "store", tmp_path / "sockets"
    node = DaemonProcess(sockets, [], "--snapshot-store", str(store), "--criu", criu).wait_ready()
    args = ["--attention-backend", "flashinfer", "--device", "cuda", "--served-model-name", "tiny"]
    args += ["--snapshot-store", str(store), "--criu", criu, "--cache-socket-dir", str(sockets)]
    servers = []
    try:
        for i in range(2):
            servers.append(start_server(tiny_llama, tmp_path / f"pod-{i}.log", args=args, prefix=POD))
            servers[-1].wait(timeout=600)
            deadline = time.monotonic() + 600
            while i == 0 and not any(re.search("snapshots: took ", line) for line in node.lines):
                assert time.monotonic() < deadline and node.proc.poll() is None, node.stderr[-3000:]
                time.sleep(0.5)
        assert [s.startup_source() for s in servers] == [("imports", "absent"), ("snapshot", "hit")]
        texts = [_complete(s.url) for s in servers]
        assert texts[0] == texts[1] and texts[0]
    finally:
        for server in servers:
            stop_pod(server.proc)
        node.terminate()


def _complete(url: str) -> str:
    body = {"model": "tiny", "prompt": "on the device", "max_tokens": 8, "temperature": 0}
    req = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as response:
        return json.loads(response.read())["choices"][0]["text"]
