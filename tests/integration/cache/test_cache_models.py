"""Bad checkpoints fail alone: validated before eviction, Failed with a reason, the rest served."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch

from keepwarm_runtime.cache.client import attach
from keepwarm_runtime.weights.checkpoint import read_checkpoint
from tests.integration.cache.test_cache_cli import cache_cli


def corrupt(model: Path) -> Path:
    """Truncate the model's largest shard by one byte: its header now points past the end."""
    shard = max(model.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 1)
    return shard


def test_one_corrupt_shard_among_three_models(checkpoint_writer, daemon_factory, tmp_path):
    models = [checkpoint_writer(tmp_path / "models" / name, seed=i) for i, name in enumerate("abc")]
    bad = corrupt(models[1])
    daemon = daemon_factory(tmp_path / "wc", models).wait_ready()
    for good in (models[0], models[2]):
        assert attach(good, tmp_path / "wc", dtype=torch.bfloat16, fallback=False).source == "cache"
    assert "ERROR" in daemon.stderr and str(bad) in daemon.stderr
    assert "Traceback" not in daemon.stderr

    ls = cache_cli("ls", "--socket", str(daemon.socket))
    assert ls.returncode == 0, ls.stderr
    rows = {line.split("\t")[0]: line for line in ls.stdout.splitlines()}
    assert set(rows) == {"a", "b", "c"}
    assert "\tFailed\t" in rows["b"] and str(bad) in rows["b"] and "past the end" in rows["b"]
    assert "Failed" not in rows["a"] + rows["c"]


def test_no_model_loads_exits_2_with_one_line(checkpoint_writer, daemon_factory, tmp_path):
    model = checkpoint_writer(tmp_path / "models" / "only", seed=1)
    corrupt(model)
    daemon = daemon_factory(tmp_path / "wc", [model])
    assert daemon.wait_exit() == 2
    assert "none of the 1 models loaded" in daemon.stderr and "Traceback" not in daemon.stderr
    assert not (tmp_path / "wc" / "host.sock").exists()


def test_second_daemon_takes_over_before_loading(checkpoint_writer, daemon_factory, tmp_path):
    model = checkpoint_writer(tmp_path / "models" / "m", seed=1)
    first = daemon_factory(tmp_path / "wc", [model]).wait_ready()
    second = daemon_factory(tmp_path / "wc", [model, tmp_path / "does-not-exist"]).wait_ready()
    assert first.wait_exit() == 0
    assert f"predecessor pid {first.proc.pid}" in second.stderr
    assert "loaded m " not in second.stderr  # handed over, not read again
    assert "does-not-exist" in second.stderr  # the model it lacked is loaded (here: fails) as usual


def test_a_bad_model_never_evicts_a_good_one(checkpoint_writer, tmp_path):
    """The node agent's path (add_model under --budget): a bad model fails before any eviction."""
    from keepwarm_runtime.cache.daemon import CacheDaemon, DaemonConfig
    from keepwarm_runtime.weights.checkpoint import CheckpointError

    good = checkpoint_writer(tmp_path / "models" / "good", seed=1)
    bad_shape = checkpoint_writer(tmp_path / "models" / "bad", seed=2)
    truncated = checkpoint_writer(tmp_path / "models" / "short", seed=3)
    corrupt(truncated)
    shard = read_checkpoint(bad_shape)[0]
    raw = shard.path.read_bytes()
    shard.path.write_bytes(raw.replace(b"[64,1024]", b"[65,1024]", 1))  # same length, wrong size
    size = sum(s.size for s in read_checkpoint(good))
    daemon = CacheDaemon(DaemonConfig(tmp_path / "wc", tier="host", dtype="bfloat16", budget=size + 4096))
    try:
        daemon.add_model(good)
        for bad, why in ((bad_shape, "do not hold"), (truncated, "past the end")):
            with pytest.raises(CheckpointError, match=why):
                daemon.add_model(bad)
            snap = daemon.snapshot()
            assert set(snap.models) == {"good"}, f"{bad.name} evicted the good model"
            failed = snap.failed[bad.name].wire()  # as stats and list show it
            assert failed["state"] == "Failed" and str(bad) in failed["reason"] and why in failed["reason"]
        from prometheus_client import generate_latest

        text = generate_latest(daemon.metrics.registry).decode()
        assert "keepwarm_cache_evictions_total 0.0" in text
        assert 'keepwarm_cache_failed_models{model="bad"} 1.0' in text
        shutil.rmtree(bad_shape)  # fixed: a good copy under the same name loads and clears Failed
        checkpoint_writer(bad_shape, seed=2)
        daemon.add_model(bad_shape)  # evicts "good" (LRU) under the budget: a valid eviction
        assert "bad" not in daemon.snapshot().failed
        assert (
            'keepwarm_cache_failed_models{model="bad"}'
            not in generate_latest(daemon.metrics.registry).decode()
        )
    finally:
        daemon.close()


def test_model_over_budget_at_start_is_a_warning(checkpoint_writer, daemon_factory, tmp_path):
    small = checkpoint_writer(tmp_path / "models" / "small", seed=1, rows=64)
    big = checkpoint_writer(tmp_path / "models" / "big", seed=2, rows=1024)
    budget = sum(s.size for s in read_checkpoint(small)) + (64 << 10)
    daemon = daemon_factory(tmp_path / "wc", [small, big], "--budget", str(budget)).wait_ready()
    time.sleep(0.2)
    assert "WARNING" in daemon.stderr and "not loading" in daemon.stderr
    assert attach(small, tmp_path / "wc", dtype=torch.bfloat16, fallback=False).source == "cache"
    assert attach(big, tmp_path / "wc", dtype=torch.bfloat16).reason == "absent"
