"""Daemon process lifecycle: the lock refuses a second daemon, a killed daemon leaves clients able to
fall back, its successor clears the stale socket, and SIGTERM removes the socket."""

from __future__ import annotations

import pytest
import torch

from keepwarm_runtime.cache.client import attach

pytestmark = pytest.mark.integration


def test_lock_kill_restart_and_sigterm(daemon_factory, checkpoint_writer, tmp_path):
    model = checkpoint_writer(tmp_path / "models" / "small", seed=3)
    socket_dir = tmp_path / "wc"
    first = daemon_factory(socket_dir, [model]).wait_ready()
    assert attach(model, socket_dir, dtype=torch.bfloat16, fallback=False).source == "cache"

    second = daemon_factory(socket_dir, [model])
    assert second.wait_exit() == 2
    assert "another keepwarm cache daemon" in second.stderr
    assert f"pid {first.proc.pid}" in second.stderr
    assert attach(model, socket_dir, dtype=torch.bfloat16, fallback=False).source == "cache"

    first.kill()  # SIGKILL mid-run: the socket file stays behind, nobody listens
    assert first.socket.exists()
    res = attach(model, socket_dir, dtype=torch.bfloat16)
    assert res.source == "disk" and res.reason.startswith("unavailable"), res.reason
    assert torch.equal(res.tensors["a.weight"], attach(model, None, dtype=torch.bfloat16).tensors["a.weight"])

    third = daemon_factory(socket_dir, [model]).wait_ready()  # takes the lock, clears the stale socket
    assert attach(model, socket_dir, dtype=torch.bfloat16, fallback=False).source == "cache"
    assert third.terminate() == 0
    assert not third.socket.exists()
    res = attach(model, socket_dir, dtype=torch.bfloat16)
    assert (res.source, res.reason.split(":")[0]) == ("disk", "unavailable")
