"""Node agent: desired models from its WeightCacheNode spec, load/evict in a real host-tier CacheDaemon,
status body."""

import dataclasses
import datetime as dt
import shutil
import threading

import pytest
import torch

from keepwarm_api.paths import PathOutsideModelDirectory
from keepwarm_api.refusals import REFUSAL_WINDOW_S
from keepwarm_api.weightcachenode import (
    DAEMON_STARTED,
    PEERS_REFUSED,
    STALE,
    WeightCacheNodeSpec,
    agent_status,
    start_failure_status,
)
from keepwarm_runtime.agent.kubernetes import NodeAgent
from keepwarm_runtime.agent.state import (
    AgentState,
    DaemonBook,
    fresh_since,
    load_options,
    node_status,
    retry_delay,
    status_differs,
    wanted_models,
)
from keepwarm_runtime.cache.security import RefusalLog
from keepwarm_testing.snapshots import daemon_snapshot, resident

SPEC = {"weightCache": "wc", "nodeName": "node-1", "heartbeatSeconds": 5, "modelDirectory": "/m"}


def spec(models):
    return WeightCacheNodeSpec.model_validate({**SPEC, "models": models})


def cache(models, generation=1):
    """A WeightCacheNode as the agent's watch delivers it."""
    return {"metadata": {"name": "wc.node-1", "generation": generation}, "spec": {**SPEC, "models": models}}


def agent(daemon, root, **kwargs):
    return NodeAgent(daemon, "wc", "node-1", kube=None, host_root=str(root), pvc_root="/pvc", **kwargs)


def passed(agent, obj):
    """One reconcile pass with its loads finished."""
    agent.reconcile(obj)
    agent.settle()


def test_wanted_models_map_sources_to_mounts():
    wanted = wanted_models(
        spec(
            [
                {"name": "a", "source": {"path": "/m/dir/a"}, "pin": True},
                {"name": "b", "source": {"pvc": {"claimName": "x"}}},
                {
                    "name": "c",
                    "source": {
                        "huggingFace": {"repo": "o/r", "revision": "abc", "tokenSecretRef": {"name": "t"}}
                    },
                },
            ]
        ),
        host_root="/host-models",
        pvc_root="/models",
    )
    assert [(w.name, w.path, w.pin) for w in wanted] == [
        ("a", "/host-models/dir/a", True),  # under the one mount of modelDirectory
        ("b", "/models/b", False),
        ("c", None, False),
    ]
    assert (wanted[2].repo, wanted[2].revision, wanted[2].token.name) == ("o/r", "abc", "t")
    with pytest.raises(PathOutsideModelDirectory, match="not under modelDirectory /m"):
        wanted_models(spec([{"name": "a", "source": {"path": "/mx/a"}}]))


def test_status_phases():
    wanted = wanted_models(
        spec([{"name": "a", "source": {"path": "/m/a"}}, {"name": "b", "source": {"path": "/m/b"}}])
    )
    state = AgentState(books={"": DaemonBook(daemon_names={"a": "a"})})
    snap = daemon_snapshot({"a": resident("a", 10)})
    status = node_status(state, {"": snap}, wanted, "0.1.0").wire()
    assert status["phase"] == "Loading" and status["totalBytes"] == 10
    assert [(m["name"], m["state"]) for m in status["models"]] == [("a", "Resident"), ("b", "Loading")]
    state.books[""].failed["b"] = "CheckpointError: no safetensors"
    status = node_status(state, {"": snap}, wanted, "0.1.0").wire()
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
    agent_ = agent(daemon, model_root)
    try:
        models = [
            {"name": "llama-a", "source": {"path": "/m/llama-a"}, "pin": True},
            {"name": "broken", "source": {"path": "/m/broken"}},
        ]
        passed(agent_, cache(models))
        snap = daemon.snapshot()
        assert set(snap.models) == {"llama-a"} and snap.models["llama-a"].pinned
        status = node_status(agent_.state, agent_.snapshots(), agent_.wanted, "v").wire()
        assert status["phase"] == "Degraded"
        assert {m["name"]: m["state"] for m in status["models"]} == {
            "llama-a": "Resident",
            "broken": "Failed",
        }
        assert status["models"][0]["bytes"] > 0 and status["models"][0]["fingerprint"]
        passed(agent_, cache(models))  # level-based: a second pass changes nothing, retries no failure
        assert set(daemon.snapshot().models) == {"llama-a"} and "broken" in agent_.state.books[""].failed
        passed(agent_, cache([{"name": "llama-b", "source": {"path": "/m/llama-b"}}], generation=2))
        assert set(daemon.snapshot().models) == {"llama-b"}
        status = node_status(agent_.state, agent_.snapshots(), agent_.wanted, "v").wire()
        assert status["phase"] == "Ready" and [m["name"] for m in status["models"]] == ["llama-b"]
    finally:
        daemon.close()


def test_a_model_the_daemon_already_holds_is_resident_from_the_first_pass(model_root, tmp_path):
    """As after a hand-off or a restart through the holder: the daemon holds the model before this
    agent exists. The agent books it in its first pass (no load job, so never reported Loading) and
    writes no status before that pass (it would list no models)."""
    from keepwarm_runtime.cache.daemon import CacheDaemon, DaemonConfig

    daemon = CacheDaemon(DaemonConfig(socket_dir=tmp_path / "sock", tier="host", dtype="bfloat16"))
    try:
        daemon.add_model(model_root / "llama-a")  # the predecessor's arena, taken over at start
        agent_ = agent(daemon, model_root)  # kube=None: a status write would fail
        assert agent_.report()  # before any pass: nothing written
        agent_.reconcile(cache([{"name": "llama-a", "source": {"path": "/m/llama-a"}, "pin": True}]))
        assert not agent_.inflight  # booked in the pass itself, not loaded on the pool
        status = node_status(agent_.state, agent_.snapshots(), agent_.wanted, "v").wire()
        assert [(m["name"], m["state"], m["pinned"]) for m in status["models"]] == [
            ("llama-a", "Resident", True)
        ]
        assert daemon.snapshot().models["llama-a"].pinned  # the spec's pin reached the daemon
    finally:
        daemon.close()


def test_stale_condition_keeps_its_transition_time_across_heartbeats():
    wanted = wanted_models(spec([{"name": "a", "source": {"path": "/m/a"}}]))
    state = AgentState(reporting_since=dt.datetime(2026, 1, 1, tzinfo=dt.UTC))
    snap = daemon_snapshot()
    first = node_status(state, {"": snap}, wanted, "v").wire()
    second = node_status(state, {"": snap}, wanted, "v").wire()
    assert first["conditions"] == second["conditions"]
    assert first["conditions"][0] | {"lastTransitionTime": "2026-01-01T00:00:00Z"} == first["conditions"][0]
    assert first["conditions"][0]["status"] == "False" and first["conditions"][0]["type"] == "Stale"


def test_a_steady_node_needs_no_status_write_and_transitions_only_after_stale():
    wanted = wanted_models(spec([{"name": "a", "source": {"path": "/m/a"}}]))
    start = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    state = AgentState(reporting_since=start)
    snap = {"": daemon_snapshot()}
    stored = node_status(state, snap, wanted, "v").wire()
    stored["heartbeat"] = "2025-12-31T23:00:00Z"  # written an hour ago: only the stamp differs
    assert not status_differs(stored, node_status(state, snap, wanted, "v"))
    assert status_differs(None, node_status(state, snap, wanted, "v"))
    loaded = {"": daemon_snapshot({"a": resident("a", 8)})}
    state.books[""] = DaemonBook(daemon_names={"a": "a"})
    assert status_differs(stored, node_status(state, loaded, wanted, "v"))  # a real change

    later = start + dt.timedelta(hours=2)
    assert fresh_since(stored, start, later) == start  # Stale=False as stored: keeps its time
    assert fresh_since(None, start, later) == start
    marked = {**stored, "phase": "Stale", "conditions": [{**stored["conditions"][0], "status": "True"}]}
    assert fresh_since(marked, start, later) == later  # the operator marked it Stale: a transition
    state.reporting_since = fresh_since(marked, start, later)
    assert status_differs(marked, node_status(state, loaded, wanted, "v"))


def test_refused_clients_show_on_the_node_while_recent():
    """A pod the daemon refuses loads from disk; its user finds why on the WeightCacheNode
    (PeersRefused), for REFUSAL_WINDOW_S after the last refusal."""
    start = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    log = RefusalLog()
    log.record("uid 1 with gids [1] is not allowed", start)
    log.record("uid 2 with gids [2] is not allowed", start + dt.timedelta(seconds=30))
    episode = log.latest()
    assert (episode.count, episode.since, episode.reason) == (2, start, "uid 2 with gids [2] is not allowed")
    quiet = start + dt.timedelta(seconds=30 + REFUSAL_WINDOW_S)
    log.record("uid 3 with gids [3] is not allowed", quiet)
    assert (log.latest().count, log.latest().since) == (1, quiet)  # a new episode

    def conditions(at):
        return {c.type: c for c in agent_status([], [], "v", "", at, start, refusals=episode).conditions}

    refused = conditions(start + dt.timedelta(seconds=31))[PEERS_REFUSED]
    assert (refused.status, refused.reason, refused.last_transition_time) == ("True", "PeerNotAllowed", start)
    assert refused.message.startswith(
        "uid 2 with gids [2] is not allowed (2 refused since 2026-01-01T00:00:00Z"
    )
    assert PEERS_REFUSED not in conditions(quiet)  # quiet for the window: the condition goes

    # From the daemons' snapshots as the agent reads them: the latest episode of any GPU's.
    wanted = wanted_models(spec([]))
    state = AgentState(reporting_since=start)
    older = RefusalLog()
    older.record("uid 7 with gids [7] is not allowed", dt.datetime.now(dt.UTC) - dt.timedelta(seconds=60))
    newer = RefusalLog()
    newer.record("uid 8 with gids [8] is not allowed")
    snaps = {
        "GPU-a": daemon_snapshot(gpu_uuid="GPU-a", refusals=older.latest()),
        "GPU-b": daemon_snapshot(gpu_uuid="GPU-b", refusals=newer.latest()),
    }
    status = node_status(state, snaps, wanted, "v").wire()
    (cond,) = [c for c in status["conditions"] if c["type"] == PEERS_REFUSED]
    assert cond["message"].startswith("uid 8 ")
    quiet_snaps = {key: dataclasses.replace(snap, refusals=None) for key, snap in snaps.items()}
    assert [c["type"] for c in node_status(state, quiet_snaps, wanted, "v").wire()["conditions"]] == ["Stale"]


def test_a_start_failure_keeps_the_nodes_other_conditions_and_its_own_transition_time():
    start = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    stored = node_status(AgentState(reporting_since=start), {"": daemon_snapshot()}, [], "v").wire()
    first = start_failure_status(stored, "CacheSecurityError: socket directory /s is owned by uid 7", start)
    assert first["phase"] == "Degraded" and first["message"].endswith("owned by uid 7")
    assert [c["type"] for c in first["conditions"]] == [STALE, DAEMON_STARTED]
    assert first["conditions"][0] == stored["conditions"][0]  # the agent's Stale=False, untouched
    later = start + dt.timedelta(minutes=5)
    again = start_failure_status({**stored, **first}, "CacheSecurityError: same", later)
    (failed,) = [c for c in again["conditions"] if c["type"] == DAEMON_STARTED]
    assert failed["lastTransitionTime"] == "2026-01-01T00:00:00Z" and failed["message"].endswith("same")


def test_load_options_carry_pin_and_quantization():
    wanted = wanted_models(
        spec(
            [
                {"name": "a", "source": {"path": "/m/a"}, "quantization": "fp8", "pin": True},
                {"name": "b", "source": {"path": "/m/b"}},
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
    agent_ = agent(daemon, model_root)
    try:
        models = [
            {"name": "llama-a", "source": {"path": "/m/llama-a"}, "quantization": "fp8", "pin": True},
            {"name": "llama-b", "source": {"path": "/m/llama-b"}},
        ]
        passed(agent_, cache(models))
        held = daemon.snapshot().models
        assert held["llama-a"].key.quantization.startswith("online:fp8:block=128x128")
        assert held["llama-b"].key.quantization == "none"
        a = daemon.registry.get("llama-a")
        assert a.quantization == "fp8" and a.layout.quantized
        assert {e.dtype for e in a.layout.entries if e.name in a.layout.quantized} == {torch.float8_e4m3fn}
        passed(agent_, cache(models))  # the pinned model is neither reloaded nor loaded unquantized
        assert daemon.registry.get("llama-a") is a
        status = node_status(agent_.state, agent_.snapshots(), agent_.wanted, "v").wire()
        assert [m["state"] for m in status["models"]] == ["Resident", "Resident"]
    finally:
        daemon.close()


def test_retry_backoff_doubles_and_is_capped():
    assert [retry_delay(n, 10, 600) for n in (1, 2, 3, 7, 50)] == [10, 20, 40, 600, 600]


def test_a_failed_model_recovers_by_itself_once_the_fault_is_gone(model_root, tiny_llama, tmp_path):
    from keepwarm_runtime.cache.daemon import CacheDaemon, DaemonConfig

    daemon = CacheDaemon(DaemonConfig(socket_dir=tmp_path / "sock", tier="host", dtype="bfloat16"))
    waiting = agent(daemon, model_root)
    eager = agent(daemon, model_root, retry_base_s=0)
    try:
        models = [{"name": "broken", "source": {"path": "/m/broken"}}]
        passed(waiting, cache(models))
        status = node_status(waiting.state, waiting.snapshots(), waiting.wanted, "v").wire()
        model = status["models"][0]
        assert model["state"] == "Failed" and model["attempts"] == 1
        assert "(attempt 1; retrying at " in model["message"]
        retry_at = dt.datetime.fromisoformat(model["retryAt"])
        assert 9 <= (retry_at - dt.datetime.now(dt.UTC)).total_seconds() <= 11  # the first backoff, 10 s
        passed(eager, cache(models))
        passed(eager, cache(models))
        assert eager.state.books[""].attempts["broken"] == 2  # retried at once (no backoff), failed again
        shutil.rmtree(model_root / "broken")
        shutil.copytree(tiny_llama, model_root / "broken")  # the fault is fixed; the spec is not touched
        passed(waiting, cache(models))
        assert "broken" in waiting.state.books[""].failed  # its backoff has not passed yet
        passed(eager, cache(models))
        status = node_status(eager.state, eager.snapshots(), eager.wanted, "v").wire()
        assert status["models"][0]["state"] == "Resident" and status["phase"] == "Ready"
        assert not eager.state.books[""].attempts and not eager.state.books[""].failed
    finally:
        daemon.close()


def test_a_hung_download_does_not_hold_up_the_other_models(model_root, tmp_path):
    """Loads run on the pool: a model whose source never answers stays Loading, the rest load."""
    from keepwarm_runtime.cache.daemon import CacheDaemon, DaemonConfig

    release = threading.Event()

    class HungHub(NodeAgent):
        def _path(self, w):
            if w.repo is not None:
                release.wait(60)  # a download that stalls until the test lets it fail
                raise TimeoutError("read timed out")
            return super()._path(w)

    daemon = CacheDaemon(DaemonConfig(socket_dir=tmp_path / "sock", tier="host", dtype="bfloat16"))
    agent_ = HungHub(daemon, "wc", "node-1", kube=None, host_root=str(model_root), max_loads=2)
    try:
        models = [
            {"name": "hub", "source": {"huggingFace": {"repo": "o/r", "revision": "main"}}},
            {"name": "llama-a", "source": {"path": "/m/llama-a"}},
        ]
        agent_.reconcile(cache(models))
        agent_.inflight[("", "llama-a")].result(timeout=120)
        status = node_status(agent_.state, agent_.snapshots(), agent_.wanted, "v").wire()
        assert {m["name"]: m["state"] for m in status["models"]} == {"hub": "Loading", "llama-a": "Resident"}
        release.set()
        agent_.settle()
        status = node_status(agent_.state, agent_.snapshots(), agent_.wanted, "v").wire()
        assert status["models"][0]["state"] == "Failed" and "read timed out" in status["models"][0]["message"]
    finally:
        release.set()
        daemon.close()
