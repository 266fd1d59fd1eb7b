"""Per-GPU residency: the warm rule (a node holds a model when every GPU holds it), each model's
node-level entry combined over the GPUs, and the agent driving one real daemon per (fake) GPU."""

import shutil
import threading

import pytest

from keepwarm_api.weightcache import WeightCacheSpec
from keepwarm_api.weightcachenode import (
    ModelState,
    ResidentModel,
    WeightCacheNodeStatus,
    combine_gpus,
    resident_models,
)
from keepwarm_operator.status import node_warm_labels, weightcache_status
from keepwarm_runtime.agent.kubernetes import NodeAgent
from keepwarm_runtime.agent.state import node_status

GPUS = ["GPU-f0", "GPU-f1", "GPU-f2", "GPU-f3"]
R, L, F, E = ModelState.RESIDENT, ModelState.LOADING, ModelState.FAILED, ModelState.EVICTED


def per_gpu(states: dict[str, dict[str, str]]) -> WeightCacheNodeStatus:
    """A status with per-GPU reports: GPU UUID -> model name -> state (the node-level entries are
    left Resident on purpose: the warm rule reads the GPUs)."""
    names = sorted({n for models in states.values() for n in models})
    return WeightCacheNodeStatus.model_validate(
        {
            "phase": "Ready",
            "models": [{"name": n, "state": "Resident"} for n in names],
            "gpus": [
                {"uuid": u, "models": [{"name": n, "state": s} for n, s in models.items()]}
                for u, models in states.items()
            ],
        }
    )


def test_a_node_is_warm_for_a_model_only_when_every_gpu_holds_it():
    everywhere = per_gpu({u: {"a": "Resident", "b": "Resident"} for u in GPUS})
    assert everywhere.resident() == {"a", "b"}
    one_missing = per_gpu(
        {**{u: {"a": "Resident", "b": "Resident"} for u in GPUS}, "GPU-f3": {"a": "Resident"}}
    )
    assert one_missing.resident() == {"a"}  # b is absent on GPU-f3
    one_failed = per_gpu({**{u: {"a": "Resident"} for u in GPUS}, "GPU-f1": {"a": "Failed"}})
    assert one_failed.resident() == set()
    host = WeightCacheNodeStatus.model_validate({"models": [{"name": "a", "state": "Resident"}]})
    assert host.resident() == {"a"} == resident_models(host.models, [])  # host tier: no per-GPU reports
    stale = everywhere.model_copy(update={"phase": "Stale"})
    assert stale.resident() == set()


def test_labels_and_cache_status_follow_the_per_gpu_truth():
    spec = WeightCacheSpec.model_validate({"models": [{"name": "a", "source": {"path": "/a"}}]})
    warm = per_gpu({u: {"a": "Resident"} for u in GPUS})
    cold = per_gpu({**{u: {"a": "Resident"} for u in GPUS}, "GPU-f2": {"a": "Loading"}})
    wcn = {"spec": {"weightCache": "c", "nodeName": "n"}}
    assert node_warm_labels([{**wcn, "status": warm.wire()}]) == {"warm.keepwarm.dev/c.a": "true"}
    assert node_warm_labels([{**wcn, "status": cold.wire()}]) == {}
    status = weightcache_status(spec, 1, 2, [warm, cold])
    assert status.ready_nodes == 1 and status.models[0].resident_nodes == 1


def entry(state: ModelState, **kw) -> ResidentModel:
    return ResidentModel(name="a", state=state, bytes=10 if state == R else 0, fingerprint="k", **kw)


def test_combined_entry_names_the_gpus_a_model_is_missing_on():
    held = combine_gpus({u: entry(R) for u in GPUS})
    assert (held.state, held.bytes, held.gpu_uuids) == (R, 40, GPUS)
    partial = combine_gpus({"GPU-f0": entry(R), "GPU-f1": entry(L)})
    assert (partial.state, partial.gpu_uuids, partial.message) == (L, ["GPU-f0"], "loading on GPU-f1")
    failed = combine_gpus(
        {"GPU-f0": entry(R), "GPU-f1": entry(F, message="CheckpointError: x", attempts=2), "GPU-f2": entry(E)}
    )
    assert failed.state == F and failed.message == "GPU-f1: CheckpointError: x" and failed.attempts == 2
    assert failed.fingerprint == "k" and failed.gpu_uuids == ["GPU-f0"]
    evicted = combine_gpus({"GPU-f0": entry(R), "GPU-f1": entry(E, message="evicted under the budget")})
    assert (evicted.state, evicted.message) == (E, "GPU-f1: evicted under the budget")


@pytest.fixture
def fake_gpu_daemons(tmp_path):
    """Four real daemons as `keepwarm cache serve --fake-gpu ...` runs them (host-memory twins)."""
    from keepwarm_runtime.cache.daemon import CacheDaemon, DaemonConfig

    daemons = [
        CacheDaemon(DaemonConfig(socket_dir=tmp_path / "sock", tier="host", fake_gpu_uuid=u)) for u in GPUS
    ]
    yield daemons
    for d in daemons:
        d.close()


def test_agent_keeps_every_model_on_every_gpu_and_reports_each(fake_gpu_daemons, tiny_llama, tmp_path):
    root = tmp_path / "models"
    shutil.copytree(tiny_llama, root / "llama")
    (root / "broken").mkdir()
    assert [d.socket_path.name for d in fake_gpu_daemons] == [f"gpu-{u}.sock" for u in GPUS]
    agent = NodeAgent(fake_gpu_daemons, "wc", "node-1", kube=None, host_root=str(root), pvc_root="/pvc")
    spec = {"weightCache": "wc", "nodeName": "node-1", "modelDirectory": "/m"}
    models = [{"name": "llama", "source": {"path": "/m/llama"}}]
    obj = {"metadata": {"name": "wc.node-1", "generation": 1}, "spec": {**spec, "models": models}}
    agent.reconcile(obj)
    agent.settle()
    status = node_status(agent.state, agent.snapshots(), agent.wanted, "v")
    assert [g.uuid for g in status.gpus] == GPUS and status.gpu_uuids == GPUS
    assert all([(m.name, m.state) for m in g.models] == [("llama", R)] for g in status.gpus)
    (llama,) = status.models
    assert llama.state == R and llama.gpu_uuids == GPUS and status.phase.value == "Ready"
    assert status.resident() == {"llama"} and llama.bytes == 4 * status.gpus[0].models[0].bytes
    # GPU-f3's daemon drops it (as under its budget): reported there, and the node is no longer warm.
    fake_gpu_daemons[3].remove_model(next(iter(fake_gpu_daemons[3].snapshot().models)))
    (root / "llama").rename(root / "gone")  # its reload fails, so it stays missing there
    agent.reconcile(obj)
    status = node_status(agent.state, agent.snapshots(), agent.wanted, "v")
    assert [m.state for g in status.gpus for m in g.models] == [R, R, R, E]
    assert status.models[0].state == E and status.models[0].message.startswith("GPU-f3: evicted")
    assert status.resident() == set()
    agent.retry_base_s = 0  # retry now: the files are gone, so GPU-f3 fails by name
    agent.state.books["GPU-f3"].retry_at.clear()
    agent.reconcile(obj)
    agent.settle()
    status = node_status(agent.state, agent.snapshots(), agent.wanted, "v")
    gpu3 = status.gpus[3].models[0]
    assert gpu3.state == F and str(root / "llama") in gpu3.message and status.phase.value == "Degraded"
    assert [m.state for g in status.gpus[:3] for m in g.models] == [R, R, R]  # the others keep it
    (root / "gone").rename(root / "llama")
    agent.reconcile(obj)
    agent.settle()
    status = node_status(agent.state, agent.snapshots(), agent.wanted, "v")
    assert status.resident() == {"llama"} and status.phase.value == "Ready"


def test_a_hub_model_is_downloaded_once_for_all_gpus(fake_gpu_daemons, tiny_llama, monkeypatch):
    """One job downloads; the other GPUs wait for it without taking a pool worker, then load it."""
    import keepwarm_runtime.agent.kubernetes as agent_module

    calls, release = [], threading.Event()

    def download(repo, revision, cache_dir, token, stall_s):
        calls.append((repo, revision))
        release.wait(60)  # a slow download: the other GPUs must not queue jobs behind it
        return str(tiny_llama)

    monkeypatch.setattr(agent_module, "download", download)
    agent = NodeAgent(
        fake_gpu_daemons, "wc", "node-1", kube=None, host_root="/h", pvc_root="/pvc", max_loads=1
    )
    hub = {"huggingFace": {"repo": "org/tiny", "revision": "main"}}
    obj = {
        "metadata": {"name": "wc.node-1", "generation": 1},
        "spec": {"weightCache": "wc", "nodeName": "node-1", "models": [{"name": "tiny", "source": hub}]},
    }
    agent.reconcile(obj)
    assert len(agent.inflight) == 1  # one download job, not one per GPU
    status = node_status(agent.state, agent.snapshots(), agent.wanted, "v")
    assert [m.state for g in status.gpus for m in g.models] == [L, L, L, L]
    release.set()
    for _ in range(2):
        agent.settle()
        agent.reconcile(obj)
    agent.settle()
    assert calls == [("org/tiny", "main")]
    assert node_status(agent.state, agent.snapshots(), agent.wanted, "v").resident() == {"tiny"}
