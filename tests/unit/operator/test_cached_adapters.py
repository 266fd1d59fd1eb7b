"""A WeightCache model's LoRA adapters: the API fields and their CRD, the operator's copy into each
WeightCacheNode spec and the agent pods' mounts, the agent's wanted entries, its loads into a real
host-tier daemon and the per-adapter status it reports."""

from __future__ import annotations

import pytest
import yaml
from pydantic import ValidationError

from keepwarm_api.crdgen import render_all
from keepwarm_api.weightcache import MAX_CACHED_ADAPTERS, WeightCacheSpec
from keepwarm_api.weightcachenode import WeightCacheNodeSpec, node_spec
from keepwarm_operator.builders.agent import agent_daemonset, token_secrets
from keepwarm_runtime.agent.kubernetes import NodeAgent
from keepwarm_runtime.agent.state import AgentState, DaemonBook, load_options, node_status, wanted_models
from keepwarm_runtime.cache.snapshot import DaemonSnapshot
from keepwarm_testing.snapshots import daemon_snapshot, model_key, resident
from tests.unit.cache.test_cache_adapters import write_adapter

SPEC = {"weightCache": "wc", "nodeName": "node-1", "heartbeatSeconds": 5, "modelDirectory": "/m"}
HUB = {"huggingFace": {"repo": "o/sql-lora", "revision": "abc", "tokenSecretRef": {"name": "hub"}}}


def model(name="base", adapters=(), **extra):
    return {"name": name, "source": {"path": f"/m/{name}"}, "adapters": list(adapters), **extra}


def wc_spec(models):
    return WeightCacheSpec.model_validate({"modelDirectory": "/m", "models": models})


def test_adapter_names_are_unique_within_a_model_and_bounded():
    with pytest.raises(ValidationError, match="adapter name 'sql' appears twice"):
        wc_spec([model(adapters=[{"name": "sql", "source": {"path": "/m/a"}}] * 2)])
    many = [{"name": f"a{i}", "source": {"path": f"/m/a{i}"}} for i in range(MAX_CACHED_ADAPTERS + 1)]
    with pytest.raises(ValidationError, match=f"at most {MAX_CACHED_ADAPTERS} items"):
        wc_spec([model(adapters=many)])
    with pytest.raises(ValidationError, match="pattern"):
        wc_spec([model(adapters=[{"name": "Not_A_Label", "source": {"path": "/m/a"}}])])
    # The same adapter name under two models is two adapters.
    two = wc_spec(
        [model("a", [{"name": "sql", "source": HUB}]), model("b", [{"name": "sql", "source": HUB}])]
    )
    assert [m.adapters[0].name for m in two.models] == ["sql", "sql"]


def test_the_crd_declares_adapters_as_a_keyed_bounded_list_with_the_path_rule():
    doc = yaml.safe_load(render_all()["keepwarm.dev_weightcaches.yaml"])
    spec = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    adapters = spec["properties"]["models"]["items"]["properties"]["adapters"]
    assert adapters["x-kubernetes-list-type"] == "map" and adapters["x-kubernetes-list-map-keys"] == ["name"]
    assert adapters["maxItems"] == MAX_CACHED_ADAPTERS and adapters["description"]
    source = adapters["items"]["properties"]["source"]
    assert set(source["properties"]) == {"path", "pvc", "huggingFace"} and source["x-kubernetes-validations"]
    assert any("m.adapters.all(a" in v["rule"] for v in spec["x-kubernetes-validations"])
    node = yaml.safe_load(render_all()["keepwarm.dev_weightcachenodes.yaml"])
    status = node["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    reported = status["properties"]["adapters"]
    assert reported["x-kubernetes-list-map-keys"] == ["model", "name"]
    assert set(reported["items"]["required"]) >= {"model", "name", "state"}


def test_the_operator_copies_adapters_into_the_node_spec_and_mounts_pvc_ones_in_agents():
    spec = wc_spec(
        [
            model(
                "base",
                [
                    {"name": "sql", "source": {"path": "/m/adapters/sql"}},
                    {"name": "de", "source": {"pvc": {"claimName": "adapters", "subPath": "de"}}},
                    {"name": "hub", "source": HUB},
                ],
            )
        ]
    )
    copied = node_spec("wc", "node-1", spec)
    assert [a.name for a in copied.models[0].adapters] == ["sql", "de", "hub"]
    assert token_secrets(spec) == ["hub"]  # the agents' Role may read the adapter's token Secret
    pod = agent_daemonset("wc", spec, "keepwarm", None)["spec"]["template"]["spec"]
    claims = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert [v["persistentVolumeClaim"]["claimName"] for v in claims] == ["adapters"]
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == claims[0]["name"])
    assert mount == {
        "name": claims[0]["name"],
        "mountPath": "/adapters/base/de",
        "readOnly": True,
        "subPath": "de",
    }


def test_wanted_adapters_follow_their_model_with_their_own_directories_and_kind():
    node = WeightCacheNodeSpec.model_validate(
        {
            **SPEC,
            "models": [
                model(
                    "base",
                    [
                        {"name": "sql", "source": {"path": "/m/adapters/sql"}},
                        {"name": "de", "source": {"pvc": {"claimName": "x"}}},
                        {"name": "hub", "source": HUB},
                    ],
                    pin=True,
                    quantization="fp8",
                ),
                model("other"),
            ],
        }
    )
    wanted = wanted_models(node, host_root="/host-models", pvc_root="/models", adapter_root="/adapters")
    assert [(w.name, w.path, w.kind) for w in wanted] == [
        ("base", "/host-models/base", "model"),
        ("other", "/host-models/other", "model"),
        ("base/sql", "/host-models/adapters/sql", "adapter"),
        ("base/de", "/adapters/base/de", "adapter"),
        ("base/hub", None, "adapter"),
    ]
    hub = wanted[-1]
    assert (hub.model, hub.adapter, hub.repo, hub.revision, hub.token.name) == (
        "base",
        "hub",
        "o/sql-lora",
        "abc",
        "hub",
    )
    # Pinned with its model; never quantized (adapters are held as stored).
    assert load_options(wanted[2]) == {"pin": True, "kind": "adapter"}
    assert load_options(wanted[0]) == {"pin": True, "quantization": "fp8"}


def _snap(gpu_uuid: str | None = None, **models: int) -> DaemonSnapshot:
    return daemon_snapshot({n: resident(n, b) for n, b in models.items()}, gpu_uuid=gpu_uuid)


def test_status_reports_adapters_apart_from_models():
    node = WeightCacheNodeSpec.model_validate(
        {
            **SPEC,
            "models": [
                model(
                    "base",
                    [
                        {"name": "sql", "source": {"path": "/m/sql"}},
                        {"name": "bad", "source": {"path": "/m/bad"}},
                    ],
                )
            ],
        }
    )
    wanted = wanted_models(node)
    book = DaemonBook(daemon_names={"base": "base", "base/sql": "sql"})
    state = AgentState(books={"": book})
    status = node_status(state, {"": _snap(base=100, sql=7)}, wanted, "v").wire()
    assert [(m["name"], m["state"]) for m in status["models"]] == [("base", "Resident")]
    assert [(a["model"], a["name"], a["state"], a["bytes"]) for a in status["adapters"]] == [
        ("base", "sql", "Resident", 7),
        ("base", "bad", "Loading", 0),
    ]
    assert status["phase"] == "Loading" and status["totalBytes"] == 107
    assert status["adapters"][0]["fingerprint"] == model_key("sql").digest
    book.failed["base/bad"] = "CheckpointError: /m/bad: no adapter_config.json"
    status = node_status(state, {"": _snap(base=100, sql=7)}, wanted, "v").wire()
    bad = status["adapters"][1]
    assert bad["state"] == "Failed" and bad["message"].startswith("CheckpointError") and "retryAt" not in bad
    assert status["phase"] == "Degraded" and status["models"][0]["state"] == "Resident"


def test_per_gpu_status_lists_models_per_gpu_and_combines_adapters():
    node = WeightCacheNodeSpec.model_validate(
        {**SPEC, "models": [model("base", [{"name": "sql", "source": {"path": "/m/sql"}}])]}
    )
    wanted = wanted_models(node)
    both = DaemonBook(daemon_names={"base": "base", "base/sql": "sql"})
    model_only = DaemonBook(daemon_names={"base": "base"}, loading={"base/sql"})
    state = AgentState(books={"GPU-a": both, "GPU-b": model_only})
    snaps = {
        "GPU-a": _snap("GPU-a", base=100, sql=7),
        "GPU-b": _snap("GPU-b", base=100),
    }
    status = node_status(state, snaps, wanted, "v").wire()
    assert [[m["name"] for m in g["models"]] for g in status["gpus"]] == [["base"], ["base"]]
    (sql,) = status["adapters"]
    assert (sql["state"], sql["bytes"], sql["message"]) == ("Loading", 7, "loading on GPU-b")


@pytest.fixture
def roots(tiny_llama, tmp_path):
    """modelDirectory /m as the agent pod sees it: a model, two adapters and a corrupt one."""
    import shutil

    root = tmp_path / "models"
    shutil.copytree(tiny_llama, root / "base")
    write_adapter(root / "adapters" / "sql", seed=1)
    write_adapter(root / "adapters" / "de", seed=2)
    (root / "adapters" / "broken").mkdir()
    (root / "adapters" / "broken" / "adapter_config.json").write_text("{}")
    (root / "adapters" / "broken" / "adapter_model.safetensors").write_bytes(b"not safetensors")
    return root


def test_agent_loads_adapters_as_adapters_fails_a_corrupt_one_alone_and_releases_removed_ones(
    roots, tmp_path
):
    from keepwarm_runtime.cache.daemon import CacheDaemon, DaemonConfig

    daemon = CacheDaemon(DaemonConfig(socket_dir=tmp_path / "sock", tier="host", dtype="bfloat16"))
    agent = NodeAgent(daemon, "wc", "node-1", kube=None, host_root=str(roots), pvc_root="/pvc")

    def obj(adapters, generation):
        spec = {**SPEC, "models": [model("base", adapters)]}
        return {"metadata": {"name": "wc.node-1", "generation": generation}, "spec": spec}

    def status():
        return node_status(agent.state, agent.snapshots(), agent.wanted, "v").wire()

    sql, de = ({"name": n, "source": {"path": f"/m/adapters/{n}"}} for n in ("sql", "de"))
    broken = {"name": "broken", "source": {"path": "/m/adapters/broken"}}
    try:
        agent.reconcile(obj([sql, de, broken], 1))
        agent.settle()
        held = daemon.snapshot().models
        assert {n: m.kind for n, m in held.items()} == {"base": "model", "sql": "adapter", "de": "adapter"}
        now = status()
        assert [(m["name"], m["state"]) for m in now["models"]] == [("base", "Resident")]
        states = {a["name"]: a["state"] for a in now["adapters"]}
        assert states == {"sql": "Resident", "de": "Resident", "broken": "Failed"}
        failed = next(a for a in now["adapters"] if a["name"] == "broken")
        assert "broken" in failed["message"] and failed["retryAt"] and now["phase"] == "Degraded"
        agent.reconcile(obj([de], 2))  # sql and broken removed from the spec
        agent.settle()
        assert set(daemon.snapshot().models) == {"base", "de"}
        now = status()
        assert [(a["name"], a["state"]) for a in now["adapters"]] == [("de", "Resident")]
        assert now["phase"] == "Ready"
    finally:
        daemon.close()
