"""The bytes you attach are the checkpoint you asked for: no collisions, no stale bytes (real daemon)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from keepwarm_runtime.cache.client import attach
from keepwarm_runtime.weights.checkpoint import read_checkpoint


def _stats(socket: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "keepwarm_runtime.cli", "cache", "stats", "--socket", str(socket)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def seeds(tmp_path_factory) -> list[Path]:
    """Two checkpoints of one architecture, identical headers and sizes, other weights."""
    from keepwarm_runtime.modelgen import make_model

    root = tmp_path_factory.mktemp("seeds")
    return [
        make_model(root / f"seed{s}", arch="llama", params="1M", dtype="bfloat16", seed=s) for s in (1, 2)
    ]


def test_same_architecture_other_seed_never_shares_an_arena(seeds, daemon_factory, tmp_path, assert_cached):
    one, two = seeds
    only_one = daemon_factory(tmp_path / "a", [one]).wait_ready()
    res = attach(two, tmp_path / "a", dtype=torch.bfloat16)
    assert (res.source, res.reason) == ("disk", "mismatch: files")  # the collision that used to hit
    assert_cached(attach(one, tmp_path / "a", dtype=torch.bfloat16), one, torch.bfloat16)
    only_one.terminate()

    both = daemon_factory(tmp_path / "b", [one, two]).wait_ready()
    a = attach(one, tmp_path / "b", dtype=torch.bfloat16, fallback=False)
    b = attach(two, tmp_path / "b", dtype=torch.bfloat16, fallback=False)
    assert (a.model, b.model) == ("seed1", "seed2") and a.digest != b.digest
    assert_cached(b, two, torch.bfloat16)
    name = "model.embed_tokens.weight"
    assert not torch.equal(a.tensors[name], b.tensors[name])
    models = _stats(both.socket)["models"]
    assert models["seed1"]["fingerprint"]["checkpoint"] == models["seed2"]["fingerprint"]["checkpoint"]
    assert models["seed1"]["fingerprint"]["files"] != models["seed2"]["fingerprint"]["files"]


def test_in_place_byte_flip_is_a_miss_then_reloaded(seeds, daemon_factory, tmp_path, assert_cached):
    import shutil

    model = Path(shutil.copytree(seeds[0], tmp_path / "models" / "flip"))
    daemon = daemon_factory(tmp_path / "wc", [model]).wait_ready()
    before = attach(model, tmp_path / "wc", dtype=torch.bfloat16, fallback=False)
    shard = read_checkpoint(model)[0]
    rec = shard.tensors[0]
    old = before.tensors[rec.name].clone()
    with open(shard.path, "r+b") as f:  # same size, same header, other bytes
        f.seek(rec.offset)
        data = f.read(64)
        f.seek(rec.offset)
        f.write(bytes(b ^ 0x55 for b in data))

    res = attach(model, tmp_path / "wc", dtype=torch.bfloat16)
    assert (res.source, res.reason) == ("disk", "mismatch: changed on disk")
    assert not torch.equal(res.tensors[rec.name], old)  # the fallback read the new bytes
    assert "changed on disk" in daemon.stderr
    assert torch.equal(before.tensors[rec.name], old)  # a client that attached earlier keeps its view

    deadline = time.monotonic() + 120
    while (again := attach(model, tmp_path / "wc", dtype=torch.bfloat16)).source != "cache":
        assert time.monotonic() < deadline, f"daemon did not reload: {again.reason}\n{daemon.stderr}"
        time.sleep(0.2)
    assert_cached(again, model, torch.bfloat16)
    assert again.digest != before.digest
