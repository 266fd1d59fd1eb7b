"""Node agent: desired models from a WeightCache, load/evict in a real host-tier CacheDaemon, status body."""

import datetime as dt
import shutil

import pytest
import torch

from keepwarm_api.weightcache import WeightCacheSpec
from keepwarm_runtime.agent.kubernetes import NodeAgent
from keepwarm_runtime.agent.state import AgentState, load_options, node_status, retry_delay, wanted_models


def spec(models):
    return WeightCacheSpec.model_validate({"models": models, "heartbeatSeconds": 5})


def cache(models, generation=1):
    return {
        "metadata": {"name": "wc", "generation": generation},
        "spec": {"models": models, "heartbeatSeconds": 5},
    }


def test_wanted_models_map_sources_to_mounts():
    wanted = wanted_models(
        spec(
            [
                {"name": "a", "source": {"path": "/host/a"}, "pin": True},
                {"name": "b", "source": {"pvc": {"claimName": "x"}}},
                {"name": "c", "source": {"huggingFace": {"repo": "o/r", "revision": "abc"}}},
            ]
        ),
        model_root="/models",
    )
    assert [(w.name, w.path, w.pin) for w in wanted] == [
        ("a", "/models/a", True),
        ("b", "/models/b", False),
        ("c", None, False),
    ]
    assert (wanted[2].repo, wanted[2].revision) == ("o/r", "abc")


def test_status_phases():
    wanted = wanted_models(
        spec([{"name": "a", "source": {"path": "/a"}}, {"name": "b", "source": {"path": "/b"}}])
    )
    state = AgentState(daemon_names={"a": "a"})
    snap = {
        "tier": "host",
        "gpu_uuid": None,
        "models": {"a": {"bytes": 10, "key_digest": "k", "digest": "d", "pinned": False, "gpu_uuids": []}},
    }
    status = node_status(state, snap, wanted, "0.1.0").wire()
    assert status["phase"] == "Loading" and status["totalBytes"] == 10
    assert [(m["name"], m["state"]) for m in status["models"]] == [("a", "Resident"), ("b", "Loading")]
    state.failed["b"] = "CheckpointError: no safetensors"
    status = node_status(state, snap, wanted, "0.1.0").wire()
    assert status["phase"] == "Degraded" and status["models"][1]["message"].startswith("CheckpointError")
    assert status["heartbeat"].endswith("Z")


@pytest.fixture
def model_root(tiny_llama, tmp_path):
    root = tmp_path / "models"
    root.mkdir()
    shutil.copytree(tiny_llama, root / "llama-a")
    shutil.copytree(tiny_llama, root / "llama-b")
    (root / "broken").mkdir()
    return root


def test_agent_loads_evicts_and_reports_failures(model_root, tmp_path):
    from keepwarm_runtime.cache.daemon import CacheDaemon, DaemonConfig

    daemon = CacheDaemon(DaemonConfig(socket_dir=tmp_path / "sock", tier="host", dtype="bfloat16"))
    agent = NodeAgent(daemon, "wc", "node-1", api=None, model_root=str(model_root))
    try:
        models = [
            {"name": "llama-a", "source": {"path": "/x"}, "pin": True},
            {"name": "broken", "source": {"path": "/y"}},
        ]
        agent.reconcile(cache(models))
        snap = daemon.snapshot()
        assert set(snap["models"]) == {"llama-a"} and snap["models"]["llama-a"]["pinned"]
        status = node_status(agent.state, snap, agent.wanted, "v").wire()
        assert status["phase"] == "Degraded"
        assert {m["name"]: m["state"] for m in status["models"]} == {
            "llama-a": "Resident",
            "broken": "Failed",
        }
        assert status["models"][0]["bytes"] > 0 and status["models"][0]["fingerprint"]
        agent.reconcile(cache(models))  # level-based: a second pass changes nothing, retries no failure
        assert set(daemon.snapshot()["models"]) == {"llama-a"} and "broken" in agent.state.failed
        agent.reconcile(cache([{"name": "llama-b", "source": {"path": "/z"}}], generation=2))
        assert set(daemon.snapshot()["models"]) == {"llama-b"}
        status = node_status(agent.state, daemon.snapshot(), agent.wanted, "v").wire()
        assert status["phase"] == "Ready" and [m["name"] for m in status["models"]] == ["llama-b"]
    finally:
        daemon.close()


def test_stale_condition_keeps_its_transition_time_across_heartbeats():
    wanted = wanted_models(spec([{"name": "a", "source": {"path": "/a"}}]))
    state = AgentState(reporting_since=dt.datetime(2026, 1, 1, tzinfo=dt.UTC))
    snap = {"tier": "host", "gpu_uuid": None, "models": {}}
    first = node_status(state, snap, wanted, "v").wire()
    second = node_status(state, snap, wanted, "v").wire()
    assert first["conditions"] == second["conditions"]
    assert first["conditions"][0] | {"lastTransitionTime": "2026-01-01T00:00:00Z"} == first["conditions"][0]
    assert first["conditions"][0]["status"] == "False" and first["conditions"][0]["type"] == "Stale"


def test_load_options_carry_pin_and_quantization():
    wanted = wanted_models(
        spec(
            [
                {"name": "a", "source": {"path": "/a"}, "quantization": "fp8", "pin": True},
                {"name": "b", "source": {"path": "/b"}},
            ]
        )
    )
    assert [load_options(w) for w in wanted] == [
        {"pin": True, "quantization": "fp8"},
        {"pin": False, "quantization": None},
    ]


def test_quantization_reaches_the_daemon_which_quantizes_at_load(model_root, tmp_path):
    """WeightCache `quantization: fp8` -> the agent -> `add_model(quantization="fp8")`: the arena holds
    FP8 weights under a key that says so; the same directory unquantized is a key of its own."""
    from keepwarm_runtime.cache.daemon import CacheDaemon, DaemonConfig

    daemon = CacheDaemon(DaemonConfig(socket_dir=tmp_path / "sock", tier="host", dtype="bfloat16"))
    agent = NodeAgent(daemon, "wc", "node-1", api=None, model_root=str(model_root))
    try:
        models = [
            {"name": "llama-a", "source": {"path": "/x"}, "quantization": "fp8", "pin": True},
            {"name": "llama-b", "source": {"path": "/y"}},
        ]
        agent.reconcile(cache(models))
        resident = daemon.snapshot()["models"]
        assert resident["llama-a"]["fingerprint"]["quantization"].startswith("online:fp8:block=128x128")
        assert resident["llama-b"]["fingerprint"]["quantization"] == "none"
        a = daemon.registry.get("llama-a")
        assert a.quantization == "fp8" and a.layout.quantized
        assert {e.dtype for e in a.layout.entries if e.name in a.layout.quantized} == {torch.float8_e4m3fn}
        agent.reconcile(cache(models))  # the pinned model is neither reloaded nor loaded unquantized
        assert daemon.registry.get("llama-a") is a
        status = node_status(agent.state, daemon.snapshot(), agent.wanted, "v").wire()
        assert [m["state"] for m in status["models"]] == ["Resident", "Resident"]
    finally:
        daemon.close()


def test_retry_backoff_doubles_and_is_capped():
    assert [retry_delay(n, 10, 600) for n in (1, 2, 3, 7, 50)] == [10, 20, 40, 600, 600]


def test_a_failed_model_recovers_by_itself_once_the_fault_is_gone(model_root, tiny_llama, tmp_path):
    from keepwarm_runtime.cache.daemon import CacheDaemon, DaemonConfig

    daemon = CacheDaemon(DaemonConfig(socket_dir=tmp_path / "sock", tier="host", dtype="bfloat16"))
    waiting = NodeAgent(daemon, "wc", "node-1", api=None, model_root=str(model_root))
    eager = NodeAgent(daemon, "wc", "node-1", api=None, model_root=str(model_root), retry_base_s=0)
    try:
        models = [{"name": "broken", "source": {"path": "/y"}}]
        waiting.reconcile(cache(models))
        status = node_status(waiting.state, daemon.snapshot(), waiting.wanted, "v").wire()
        assert status["models"][0]["state"] == "Failed"
        assert "(attempt 1; retrying at " in status["models"][0]["message"]
        eager.reconcile(cache(models))
        eager.reconcile(cache(models))
        assert eager.state.attempts["broken"] == 2  # retried at once (no backoff), failed again
        shutil.rmtree(model_root / "broken")
        shutil.copytree(tiny_llama, model_root / "broken")  # the fault is fixed; the spec is not touched
        waiting.reconcile(cache(models))
        assert "broken" in waiting.state.failed  # its backoff has not passed yet
        eager.reconcile(cache(models))
        status = node_status(eager.state, daemon.snapshot(), eager.wanted, "v").wire()
        assert status["models"][0]["state"] == "Resident" and status["phase"] == "Ready"
        assert not eager.state.attempts and not eager.state.failed
    finally:
        daemon.close()
