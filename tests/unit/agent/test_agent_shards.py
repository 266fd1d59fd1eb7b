"""A WeightCache model held as tensor-parallel shards (spec.models[].parallelism): which shards each of
a node's daemons holds, the agent's loads into real host-memory daemons (one, or one per fake GPU), and
the status it reports: the model Resident only with all its shards, the ranks held, per GPU."""

from __future__ import annotations

import shutil

from keepwarm_api.weightcachenode import WeightCacheNodeSpec
from keepwarm_runtime.agent.kubernetes import NodeAgent
from keepwarm_runtime.agent.state import WantedModel, load_options, node_status, shard_entries, wanted_models
from keepwarm_runtime.cache.daemon import CacheDaemon, DaemonConfig
from keepwarm_runtime.weights.tensor_parallel import Sharding

SPEC = {"weightCache": "wc", "nodeName": "node-1", "heartbeatSeconds": 5, "modelDirectory": "/m"}


def _spec(parallelism: dict | None) -> dict:
    model = {"name": "base", "source": {"path": "/m/base"}, "dtype": "bfloat16"}
    return {**SPEC, "models": [model | ({"parallelism": parallelism} if parallelism else {})]}


def test_each_daemon_holds_its_shards() -> None:
    (w,) = wanted_models(WeightCacheNodeSpec.model_validate(_spec({"tensor": 4, "expert": True})))
    assert w.parallelism.tensor == 4 and w.parallelism.expert
    host = shard_entries(w, 0, 1)  # the host tier's one daemon: every shard
    assert [(e.name, e.rank) for e in host] == [(f"base#{r}", r) for r in range(4)]
    per_gpu = [[e.rank for e in shard_entries(w, i, 8)] for i in range(8)]  # rank i mod 4 on GPU i
    assert per_gpu == [[0], [1], [2], [3], [0], [1], [2], [3]]
    assert load_options(w, 2)["sharding"] == Sharding(2, 4, expert=True)
    whole = WantedModel("base", "/m/base", pin=False)
    assert [(e.name, e.rank) for e in shard_entries(whole, 3, 8)] == [("base", None)]
    assert "sharding" not in load_options(whole)


def _agent(daemons, tiny_llama, tmp_path) -> NodeAgent:
    root = tmp_path / "models"
    shutil.copytree(tiny_llama, root / "base")
    return NodeAgent(daemons, "wc", "node-1", kube=None, host_root=str(root), pvc_root="/pvc")


def _pass(agent: NodeAgent, parallelism: dict | None, generation: int) -> dict:
    agent.reconcile({"metadata": {"name": "wc.node-1", "generation": generation}, "spec": _spec(parallelism)})
    agent.settle()
    return node_status(agent.state, agent.snapshots(), agent.wanted, "v").wire()


def test_the_agent_keeps_every_shard_in_the_host_daemon_and_reports_them(tiny_llama, tmp_path) -> None:
    daemon = CacheDaemon(DaemonConfig(socket_dir=tmp_path / "sock", tier="host", dtype="bfloat16"))
    agent = _agent(daemon, tiny_llama, tmp_path)
    try:
        status = _pass(agent, {"tensor": 2}, 1)
        held = daemon.snapshot().models
        assert sorted(held) == ["base.tp0of2", "base.tp1of2"]
        assert [held[n].key.tp_rank for n in sorted(held)] == [0, 1]
        (entry,) = status["models"]
        assert entry["state"] == "Resident" and entry["shards"] == [0, 1]
        assert entry["bytes"] == sum(m.nbytes for m in held.values())
        status = _pass(agent, None, 2)  # held whole again: the shards go, the model comes
        assert sorted(daemon.snapshot().models) == ["base"]
        assert status["models"][0]["state"] == "Resident" and not status["models"][0].get("shards")
    finally:
        agent.pool.shutdown()
        daemon.close()


def test_on_the_gpu_tier_each_gpu_holds_its_rank(tiny_llama, tmp_path) -> None:
    daemons = [
        CacheDaemon(
            DaemonConfig(socket_dir=tmp_path / "sock", tier="host", dtype="bfloat16", fake_gpu_uuid=uuid)
        )
        for uuid in ("GPU-a", "GPU-b")
    ]
    agent = _agent(daemons, tiny_llama, tmp_path)
    try:
        status = _pass(agent, {"tensor": 2}, 1)
        assert [sorted(d.snapshot().models) for d in daemons] == [["base.tp0of2"], ["base.tp1of2"]]
        gpus = {g["uuid"]: g["models"] for g in status["gpus"]}
        assert {u: [(m["state"], m["shards"]) for m in ms] for u, ms in gpus.items()} == {
            "GPU-a": [("Resident", [0])],
            "GPU-b": [("Resident", [1])],
        }
        (entry,) = status["models"]
        assert entry["state"] == "Resident" and entry["shards"] == [0, 1]
    finally:
        agent.pool.shutdown()
        for d in daemons:
            d.close()
