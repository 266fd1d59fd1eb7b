"""spec.parallelism on the real control plane: the API server's rules, the operator's Deployment for a
group of ranks, a WeightCache that holds the model split otherwise, and a group no node can hold.

Fake GPU nodes offer 4 GPUs each here. The runtime pods' command is read back with the runtime's own
parser (a renamed flag fails here, not in a pod)."""

from __future__ import annotations

import argparse
import time
import uuid
from types import SimpleNamespace

import pytest
import yaml

from keepwarm_testing.operator import (
    GROUP_PATH,
    OperatorProcess,
    condition,
    get,
    install_chart_rbac,
    install_crds,
    wait,
)

pytestmark = pytest.mark.slow
MODEL = "tiny"
GPUS_PER_NODE = 4


@pytest.fixture(scope="module")
def env(control_plane, tmp_path_factory):
    cp = control_plane
    install_crds(cp)
    install_chart_rbac(cp)
    pool = f"tp{uuid.uuid4().hex[:5]}"
    cp.add_gpu_nodes(2, labels={"pool": pool}, prefix=f"{pool}-gpu", gpus=GPUS_PER_NODE)
    ns = f"{pool}-apps"
    cp.kubectl("create", "namespace", ns)
    op = OperatorProcess(cp, tmp_path_factory.mktemp("operator")).start()
    yield SimpleNamespace(cp=cp, op=op, pool=pool, ns=ns)
    op.stop()


def _apply(env, doc: dict, check: bool = True):
    return env.cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc), check=check)


def _cache(env, name: str, parallelism: dict | None) -> dict:
    model = {"name": MODEL, "source": {"path": "/var/lib/models/tiny"}}
    if parallelism is not None:
        model["parallelism"] = parallelism
    spec = {"tier": "gpu", "nodeSelector": {"pool": env.pool}, "heartbeatSeconds": 600, "models": [model]}
    return {
        "apiVersion": "keepwarm.dev/v1alpha1",
        "kind": "WeightCache",
        "metadata": {"name": name},
        "spec": spec,
    }


def _idep(env, name: str, cache: str, **spec) -> dict:
    base = {
        "model": {"cacheRef": cache, "name": MODEL},
        "replicas": 1,
        "pod": {"nodeSelector": {"pool": env.pool}},
    }
    return {
        "apiVersion": "keepwarm.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": name, "namespace": env.ns},
        "spec": {**base, **spec},
    }


def _get_idep(env, name: str) -> dict | None:
    return get(env.cp, f"{GROUP_PATH}/namespaces/{env.ns}/inferencedeployments/{name}")


def _condition(env, name: str, type_: str, reason: str | None = None) -> dict:
    """The InferenceDeployment's ``type_`` condition once it has a reason (``reason``, when given)."""

    def seen() -> dict | None:
        found = condition(_get_idep(env, name), type_)
        return found if found.get("reason") and reason in (None, found["reason"]) else None

    return wait(env.cp, seen, f"{name}: {type_} {reason or ''}", op=env.op)


def _deployment(env, name: str) -> dict:
    path = f"/apis/apps/v1/namespaces/{env.ns}/deployments/{name}"
    return wait(env.cp, lambda: get(env.cp, path), f"Deployment {name}", op=env.op)


def _serve_settings(command: list[str]):
    from keepwarm_runtime.server import cli

    parser = argparse.ArgumentParser()
    cli.add_serve_parser(parser.add_subparsers())
    return cli.serve_settings(parser.parse_args(command[1:]), environ={})


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"parallelism": {"expert": True}}, "parallelism.expert partitions the experts"),
        ({"parallelism": {"tensor": 4}, "gpusPerPod": 2}, "a pod takes one GPU per tensor-parallel rank"),
        (
            {"parallelism": {"tensor": 2}, "lora": {"adapters": []}},
            "LoRA adapters are served on one rank only",
        ),
        ({"parallelism": {"tensor": 17}}, "should be less than or equal to 16"),
        ({"parallelism": {"tensor": 4, "nodes": 3}}, "parallelism.nodes must divide parallelism.tensor"),
        (
            {"parallelism": {"tensor": 4, "nodes": 2}, "gpusPerPod": 4},
            "takes one GPU per rank: gpusPerPod is 0",
        ),
    ],
    ids=[
        "expert-without-ranks",
        "gpus-not-one-per-rank",
        "lora-with-ranks",
        "too-many-ranks",
        "nodes-not-dividing",
        "pods-of-a-group-with-all-gpus",
    ],
)
def test_parallelism_that_cannot_work_is_refused_by_the_api_server(env, spec, message) -> None:
    result = _apply(env, _idep(env, "bad", "any", **spec), check=False)
    assert result.returncode != 0 and message in result.stderr, result.stderr


def test_a_group_attaching_matching_shards_takes_a_gpu_per_rank_and_shared_memory(env) -> None:
    _apply(env, _cache(env, "tpwc", {"tensor": 2, "expert": True}))
    _apply(env, _idep(env, "moe", "tpwc", parallelism={"tensor": 2, "expert": True}))
    pod = _deployment(env, "moe")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"  # a quantity, as the API stores it
    settings = _serve_settings(container["command"])
    assert settings.tensor_parallel_size == 2 and settings.enable_expert_parallel
    assert {"name": "keepwarm-shm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
    assert {"name": "keepwarm-shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    # no agent reports here: not resident, but no mismatch either
    assert _condition(env, "moe", "CacheWarm")["reason"] == "ModelNotResident"


def test_a_cache_holding_the_model_split_otherwise_is_named_and_the_pods_load_from_disk(env) -> None:
    _apply(env, _cache(env, "wholewc", None))
    _apply(env, _idep(env, "split", "wholewc", parallelism={"tensor": 2}))
    message = _condition(env, "split", "CacheWarm", "ParallelismMismatch")["message"]
    assert "holds tiny whole" in message and "runs it 2 tensor-parallel shards" in message
    assert "load from disk" in message
    pod = _deployment(env, "split")["spec"]["template"]["spec"]  # deployed all the same
    env_vars = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env_vars["KEEPWARM_CACHE_FALLBACK"] == "1"


def test_a_group_larger_than_any_nodes_gpus_is_refused_naming_the_largest(env) -> None:
    _apply(env, _idep(env, "huge", "tpwc", parallelism={"tensor": 8, "expert": True}))
    message = _condition(env, "huge", "Available", "TooFewGPUs")["message"]
    assert "needs 8 GPUs in one pod" in message and f"the most: {GPUS_PER_NODE}" in message
    time.sleep(1)
    assert get(env.cp, f"/apis/apps/v1/namespaces/{env.ns}/deployments/huge") is None
    assert _get_idep(env, "huge")["spec"]["parallelism"] == {"expert": True, "tensor": 8, "nodes": 1}


def test_a_group_over_pods_without_leaderworkerset_installed_is_named(env) -> None:
    """The LeaderWorkerSet API is not installed in this cluster (tests/e2e/test_parallel.py has it)."""
    _apply(env, _cache(env, "nodeswc", {"tensor": 4}))
    _apply(env, _idep(env, "spread", "nodeswc", parallelism={"tensor": 4, "nodes": 2}))
    message = _condition(env, "spread", "Available", "ApplyFailed")["message"]
    assert "applying the LeaderWorkerSet/Service failed" in message and "install sigs.k8s.io/lws" in message
    assert get(env.cp, f"/apis/apps/v1/namespaces/{env.ns}/deployments/spread") is None
    # the split matches the cache's: where the ranks run is not the cache's matter
    assert _condition(env, "spread", "CacheWarm")["reason"] == "ModelNotResident"
