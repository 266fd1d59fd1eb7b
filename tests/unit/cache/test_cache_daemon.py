"""CacheDaemon in-process (the node agent's API): add/remove/snapshot, budget, pins, bind checks."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from keepwarm_runtime.cache.client import attach
from keepwarm_runtime.cache.daemon import CacheDaemon, DaemonConfig
from keepwarm_runtime.cache.registry import BudgetExceeded
from keepwarm_runtime.cache.security import CacheSecurityError


def write_checkpoint(path: Path, seed: int) -> Path:
    """A small two-shard safetensors checkpoint (no transformers needed: the daemon reads raw files)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    save_file(
        {
            "a.weight": torch.randn(64, 64, generator=g).bfloat16(),
            "a.bias": torch.randn(64, generator=g).bfloat16(),
        },
        path / "model-1.safetensors",
    )
    save_file(
        {
            "b.weight": torch.randn(33, 17, generator=g).bfloat16(),
            "b.steps": torch.arange(5, dtype=torch.int64),
        },
        path / "model-2.safetensors",
    )
    (path / "config.json").write_text('{"architectures": ["TinyForTest"], "model_type": "tiny"}')
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("daemon-models")
    return [write_checkpoint(root / f"m{i}", seed=i) for i in range(3)]


def _daemon(tmp_path: Path, **kw) -> CacheDaemon:
    return CacheDaemon(DaemonConfig(socket_dir=tmp_path / "sock", tier="host", dtype="bfloat16", **kw))


def test_add_snapshot_remove(models, tmp_path):
    d = _daemon(tmp_path)
    name = d.add_model(models[0])
    assert d.add_model(models[0]) == name  # loading twice is a no-op
    snap = d.snapshot()
    entry = snap.models[name]
    assert entry.nbytes > 0 and entry.tier == "host" and len(entry.digest) == 64
    assert entry.key.dtype == "bfloat16"
    assert snap.resident_bytes == entry.nbytes
    assert d.remove_model(name) and not d.remove_model(name)
    assert d.snapshot().models == {}
    d.close()


def test_lru_eviction_keeps_pinned(models, tmp_path):
    probe = _daemon(tmp_path / "probe")
    size = probe.registry.get(probe.add_model(models[0])).nbytes
    probe.close()
    d = _daemon(tmp_path, budget=int(size * 2.5), pins=frozenset({"m0"}))
    d.add_model(models[0])  # pinned by name
    d.add_model(models[1])
    d.add_model(models[2])  # evicts m1, the least recently used unpinned model
    assert set(d.snapshot().models) == {"m0", "m2"}
    assert d.snapshot().models["m0"].pinned
    d.close()


def test_budget_too_small_for_pinned(models, tmp_path):
    d = _daemon(tmp_path, budget=1)
    with pytest.raises(BudgetExceeded, match="--budget"):
        d.add_model(models[0], pin=True)
    d.close()


def test_symlinked_socket_dir_refused_at_bind(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "sock").symlink_to(tmp_path / "real")
    d = _daemon(tmp_path)
    with pytest.raises(CacheSecurityError, match="symlink"):
        d.bind()


def test_serve_in_thread_and_attach(models, tmp_path):
    d = _daemon(tmp_path)
    d.add_model(models[0])
    d.bind()
    thread = threading.Thread(target=d.serve_forever)
    thread.start()
    try:
        res = attach(models[0], tmp_path / "sock", dtype=torch.bfloat16, fallback=False)
        disk = attach(models[0], None, dtype=torch.bfloat16)
        assert res.source == "cache" and res.model == "m0"
        from prometheus_client import generate_latest

        text = generate_latest(d.metrics.registry).decode()
        assert 'keepwarm_cache_hits_total{model="m0"} 1.0' in text
        assert 'keepwarm_cache_resident_bytes{model="m0",tier="host"}' in text
        assert "keepwarm_cache_attach_seconds_count 1.0" in text
        assert res.digest == d.snapshot().models["m0"].digest
        assert res.tensors.keys() == disk.tensors.keys()
        assert all(torch.equal(res.tensors[k], disk.tensors[k]) for k in disk.tensors)
        d.remove_model("m0")  # the daemon lets go; the client's mapping stays valid
        assert all(torch.equal(res.tensors[k], disk.tensors[k]) for k in disk.tensors)
        assert attach(models[0], tmp_path / "sock", dtype=torch.bfloat16).reason == "absent"
        text = generate_latest(d.metrics.registry).decode()
        assert 'keepwarm_cache_misses_total{reason="absent"} 1.0' in text
    finally:
        d.stop()
        thread.join(10)
    assert not (tmp_path / "sock" / "host.sock").exists()


def test_float32_serving_converts_floats_only(models, tmp_path):
    d = CacheDaemon(DaemonConfig(socket_dir=tmp_path / "sock", tier="host", dtype="float32"))
    d.add_model(models[1])
    d.bind()
    thread = threading.Thread(target=d.serve_forever)
    thread.start()
    try:
        res = attach(models[1], tmp_path / "sock", dtype="float32", fallback=False)
        disk = attach(models[1], None, dtype="float32")
        assert res.tensors["a.weight"].dtype == torch.float32
        assert res.tensors["b.steps"].dtype == torch.int64
        assert all(torch.equal(res.tensors[k], disk.tensors[k]) for k in disk.tensors)
    finally:
        d.stop()
        thread.join(10)


def test_changed_on_disk_reload_that_fails_drops_the_stale_arena(tmp_path):
    import shutil
    import time

    from keepwarm_runtime.weights.checkpoint import read_checkpoint

    model = write_checkpoint(tmp_path / "models" / "m", seed=5)
    d = _daemon(tmp_path)
    try:
        d.add_model(model)
        key = d.snapshot().models["m"].key.to_dict()
        shard = read_checkpoint(model)[0].path
        with open(shard, "r+b") as f:  # now shorter than its header says
            f.truncate(shard.stat().st_size - 1)
        reply, fds = d.handlers.dispatch({"cmd": "get_state", "key": key})
        assert (reply["state"], reply["reason"], fds) == ("mismatch", "changed on disk", [])
        deadline = time.monotonic() + 30
        while "m" in d.snapshot().models:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        failed = d.snapshot().failed["m"]
        assert "past the end" in failed.reason and str(shard) in failed.reason
        shutil.rmtree(model)
    finally:
        d.close()


def test_online_quantization_is_refused_by_name_where_it_cannot_apply(models, tmp_path):
    """A model transformers cannot build (so no one can tell its linear weights) and a method other than
    fp8 are Failed with the reason; nothing is loaded unquantized under either name."""
    from keepwarm_runtime.weights.quantization import QuantizationError

    d = _daemon(tmp_path)
    try:
        with pytest.raises(QuantizationError, match="transformers cannot build"):
            d.add_model(models[0], quantization="fp8")
        with pytest.raises(QuantizationError, match="online quantization 'int4' is not supported"):
            d.add_model(models[1], quantization="int4")
        snap = d.snapshot()
        assert snap.models == {} and set(snap.failed) == {"m0", "m1"}
    finally:
        d.close()


def test_a_quantized_model_changed_on_disk_reloads_quantized(tiny_llama, tmp_path):
    import os
    import shutil
    import time

    from keepwarm_runtime.weights.checkpoint import read_checkpoint

    model = shutil.copytree(tiny_llama, tmp_path / "models" / "llama")
    d = _daemon(tmp_path)
    try:
        name = d.add_model(model, quantization="fp8")
        before = d.registry.get(name)
        assert before.layout.quantized and before.key.quantization.startswith("online:fp8")
        shard = read_checkpoint(model)[0].path
        os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 1_000_000_000))
        reply, _ = d.handlers.dispatch({"cmd": "get_state", "key": before.key.to_dict()})
        assert (reply["state"], reply["reason"]) == ("mismatch", "changed on disk")
        deadline = time.monotonic() + 60
        while (after := d.registry.get(name)) is before or after is None:  # replaced, not between
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert after.quantization == "fp8" and after.key.diff(before.key) == ["files"]
        assert after.layout.quantized.keys() == before.layout.quantized.keys()
    finally:
        d.close()
