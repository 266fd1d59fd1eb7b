"""Daemon process lifecycle: a second daemon takes over from the first, a killed daemon leaves clients
able to fall back, its successor clears the stale socket, and SIGTERM removes the socket."""

from __future__ import annotations

import torch

from keepwarm_runtime.cache.client import attach


def test_lock_kill_restart_and_sigterm(daemon_factory, checkpoint_writer, tmp_path):
    model = checkpoint_writer(tmp_path / "models" / "small", seed=3)
    socket_dir = tmp_path / "wc"
    first = daemon_factory(socket_dir, [model]).wait_ready()
    assert attach(model, socket_dir, dtype=torch.bfloat16, fallback=False).source == "cache"

    second = daemon_factory(socket_dir, [model]).wait_ready()  # takes over (cache/succession.py)
    assert first.wait_exit() == 0
    assert "took 1 arenas from the predecessor" in second.stderr and "loaded" not in second.stderr
    assert attach(model, socket_dir, dtype=torch.bfloat16, fallback=False).source == "cache"

    second.kill()  # SIGKILL mid-run: the socket file stays behind, nobody listens (and no holder)
    assert second.socket.exists()
    res = attach(model, socket_dir, dtype=torch.bfloat16)
    assert res.source == "disk" and res.reason.startswith("unavailable"), res.reason
    assert torch.equal(res.tensors["a.weight"], attach(model, None, dtype=torch.bfloat16).tensors["a.weight"])

    third = daemon_factory(socket_dir, [model]).wait_ready()  # takes the lock, clears the stale socket
    assert attach(model, socket_dir, dtype=torch.bfloat16, fallback=False).source == "cache"
    assert third.terminate() == 0
    assert not third.socket.exists()
    res = attach(model, socket_dir, dtype=torch.bfloat16)
    assert (res.source, res.reason.split(":")[0]) == ("disk", "unavailable")
