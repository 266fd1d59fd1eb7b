"""A restarted daemon answers from what it adopted before it imports torch (issue 34 item 6).

Real daemons and a real holder: the daemon that loaded from disk has torch's library in its memory
map (the probe's positive control); one restarted after a SIGKILL, or a successor of a hand-off,
serves a cache hit of the adopted arena and still has not imported torch, so its answer came before
any import of torch. Only a load from disk imports it (cache/loading.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from keepwarm_runtime.cache import holder
from keepwarm_runtime.cache.client import attach
from tests.integration.cache.probes import wait_for


def _disk(model: Path) -> dict[str, torch.Tensor]:
    return attach(model, None, dtype=torch.bfloat16).tensors


def _attach_from_cache(model: Path, socket_dir: Path) -> None:
    res = attach(model, socket_dir, dtype=torch.bfloat16, fallback=False)
    assert res.source == "cache"
    assert all(torch.equal(res.tensors[n], t) for n, t in _disk(model).items())


def test_a_daemon_restarted_after_a_crash_answers_before_importing_torch(
    daemon_factory, holder_factory, checkpoint_writer, tmp_path
):
    model = checkpoint_writer(tmp_path / "models" / "m", seed=3, rows=256)
    socket_dir = tmp_path / "wc"
    holder_factory(socket_dir)
    first = daemon_factory(socket_dir, [model]).wait_ready()
    assert first.imported_torch()  # it read the checkpoint: the probe sees torch when it is there
    wait_for(lambda: holder.count(socket_dir, "host.sock") == 1)
    first.kill()

    second = daemon_factory(socket_dir, [model]).wait_ready()
    _attach_from_cache(model, socket_dir)
    assert not second.imported_torch(), second.stderr  # the hit was answered without torch
    assert "took 1 arenas from the holder" in second.stderr and "loaded" not in second.stderr
    assert second.terminate() == 0


def test_a_successor_serves_what_it_took_over_before_importing_torch(
    daemon_factory, checkpoint_writer, tmp_path
):
    models = [checkpoint_writer(tmp_path / "models" / f"m{i}", seed=i, rows=128) for i in range(2)]
    socket_dir = tmp_path / "wc"
    first = daemon_factory(socket_dir, models).wait_ready()
    second = daemon_factory(socket_dir, models).wait_ready()
    assert first.wait_exit() == 0
    for model in models:
        _attach_from_cache(model, socket_dir)
    assert not second.imported_torch(), second.stderr
    assert "took 2 arenas from the predecessor" in second.stderr


def test_a_model_it_must_read_is_loaded_with_torch_imported_then(daemon_factory, checkpoint_writer, tmp_path):
    """The lazy import is really taken: a successor that also loads a new model reads it (torch)."""
    kept = checkpoint_writer(tmp_path / "models" / "kept", seed=1)
    new = checkpoint_writer(tmp_path / "models" / "new", seed=2)
    socket_dir = tmp_path / "wc"
    first = daemon_factory(socket_dir, [kept]).wait_ready()
    second = daemon_factory(socket_dir, [kept, new]).wait_ready()
    assert first.wait_exit() == 0
    assert "took 1 arenas from the predecessor" in second.stderr and "loaded new " in second.stderr
    assert second.imported_torch()
    for model in (kept, new):
        _attach_from_cache(model, socket_dir)
