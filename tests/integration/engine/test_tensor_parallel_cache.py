"""The node cache holds tensor-parallel shards (`keepwarm cache serve --tensor-parallel-size 2`), one
arena per shard, and each rank of a group attaches its own.

Real daemon processes (host tier: every shard in the one daemon) and real 2-rank groups (gloo on CPU).
A shard is keyed by its rank and size (and expert parallel in its conversion), so a rank never
attaches another rank's slice nor the whole model; a rank whose shard the daemon lacks loads its
slice from disk alone, and says so, while the other ranks attach theirs; what the group generates is
what one process generates from disk.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from keepwarm_runtime import LLM, SamplingParams
from keepwarm_runtime.cache.client import attach, connect, request
from keepwarm_runtime.cache.launcher import DaemonProcess
from keepwarm_runtime.weights.tensor_parallel import Sharding
from tests.sweep.judge import conditions

pytestmark = [pytest.mark.slow, pytest.mark.extended]

# (architecture, expert parallel): a dense model's shards, and a MoE model's experts partitioned
CASES = [("llama", False), ("qwen3_moe", True)]


def _stats(daemon: DaemonProcess) -> dict:
    with connect(daemon.socket, timeout_s=10.0) as sock:
        reply, _ = request(sock, {"cmd": "stats"})
    return reply


def _generate(llm: LLM) -> list[list[int]]:
    prompts = [{"prompt_token_ids": list(p)} for p in conditions()[1].prompts]
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _llm(model_dir: Path, expert: bool, socket_dir: Path | None, size: int = 2) -> LLM:
    return LLM(
        model_dir,
        dtype="float32",
        block_size=4,
        num_kv_blocks=128,
        tensor_parallel_size=size,
        enable_expert_parallel=expert,
        cache_socket_dir=str(socket_dir) if socket_dir else None,
    )


@pytest.fixture(scope="module", params=CASES, ids=[a for a, _ in CASES])
def shards(request, make_tiny, tmp_path_factory):
    arch, expert = request.param
    model_dir = make_tiny(arch)
    extra = ["--dtype", "float32", "--tensor-parallel-size", "2"] + (
        ["--enable-expert-parallel"] if expert else []
    )
    daemon = DaemonProcess(tmp_path_factory.mktemp(f"shards-{arch}"), [model_dir], *extra)
    daemon.wait_ready()
    yield model_dir, expert, daemon
    daemon.kill()


def test_each_rank_attaches_its_own_shard(shards) -> None:
    model_dir, expert, daemon = shards
    kind = "ep" if expert else "tp"
    names = [f"{model_dir.name}.{kind}{rank}of2" for rank in range(2)]
    before = _stats(daemon)["models"]
    assert sorted(before) == names  # one arena per shard, each about half of the model
    whole = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    assert all(before[n]["bytes"] < 0.75 * whole for n in names)
    assert [before[n]["fingerprint"]["tp_rank"] for n in names] == [0, 1]
    llm = _llm(model_dir, expert, daemon.socket_dir)
    try:
        assert llm.engine.load_info.source == "cache"
        got = _generate(llm)
    finally:
        llm.close()
    after = _stats(daemon)["models"]
    assert all(after[n]["hits"] == before[n]["hits"] + 1 for n in names)  # rank 1 attached its own too
    assert got == _generate(_llm(model_dir, expert, None, size=1))


def test_a_rank_whose_shard_is_missing_loads_from_disk_and_says_so(shards, capfd) -> None:
    model_dir, expert, daemon = shards
    kind = "ep" if expert else "tp"
    with connect(daemon.socket, timeout_s=10.0) as sock:
        request(sock, {"cmd": "release", "model": f"{model_dir.name}.{kind}1of2"})
    llm = _llm(model_dir, expert, daemon.socket_dir)
    try:
        assert llm.engine.load_info.source == "cache"  # rank 0's shard is still there
        got = _generate(llm)
    finally:
        llm.close()
    assert "rank 1 of 2: its shard loads from disk (mismatch: tp_rank)" in capfd.readouterr().err
    assert got == _generate(_llm(model_dir, expert, None, size=1))


def test_the_key_keeps_shards_apart(shards) -> None:
    model_dir, expert, daemon = shards
    whole = attach(model_dir, daemon.socket_dir, dtype="float32", sharding=Sharding(0, 1))
    assert whole.source == "disk" and "tp_size" in whole.reason, whole.reason
    other = Sharding(0, 2, not expert)  # the other way of splitting the experts (a dense model: EP)
    result = attach(model_dir, daemon.socket_dir, dtype="float32", sharding=other)
    assert result.source == "disk" and result.reason == "mismatch: conversion", result.reason
