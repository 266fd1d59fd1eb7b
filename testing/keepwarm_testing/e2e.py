"""What the end-to-end tests on real pods (tests/e2e) share: the cluster, the chart, the objects a user
applies, and how a test looks at pods, asks a runtime pod and reads its metrics.

`pod_cluster` is one control plane with one real node (root only: the kubelet on containerd and runc,
images built from the repository's Dockerfile and pulled from a registry on loopback; see
keepwarm_testing.node), and a random-weight model under the WeightCache's default modelDirectory
(MODEL_DIR). The node's filesystem is this machine's, so hostPaths are real paths: what a cluster
creates under the node's well-known folders (HOST_PATHS) is removed when it stops. Each e2e module gets
its own cluster (tests/e2e/conftest.py).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import helm_python as helm
import httpx
import openai
import yaml

from keepwarm_api.inferencedeployment import DEFAULT_CPU_IMAGE
from keepwarm_api.weightcache import DEFAULT_SNAPSHOT_DIRECTORY, WeightCacheSpec
from keepwarm_testing.controlplane.build import build_control_plane
from keepwarm_testing.controlplane.cluster import ControlPlane
from keepwarm_testing.operator import CHART, GROUP_PATH, NAMESPACE, RELEASE, condition, items, samples

MODEL = "tiny"
MODEL_DIR = "/var/lib/models/tiny"  # on the node, under the WeightCache's default modelDirectory
PROMPT = [{"role": "user", "content": "Say something."}]
OPERATOR = "app.kubernetes.io/name=keepwarm-operator"
RUNTIME_IMAGE = DEFAULT_CPU_IMAGE  # the nodes run CPU pods: the Dockerfile's runtime-cpu target
# The node folders a cluster writes to (models, the agents' socket directories, downloads and process
# snapshots): what it adds there goes when it stops.
HOST_PATHS = (
    Path("/var/lib/models"),
    Path("/var/run/keepwarm"),
    Path(WeightCacheSpec.model_fields["download_directory"].default),
    Path(DEFAULT_SNAPSHOT_DIRECTORY),
)


@contextmanager
def real_cluster(failed: Callable[[], bool]) -> Iterator[ControlPlane]:
    """A started control plane that runs pods on real nodes (none added yet). At the end it stops,
    keeping every component and container log beside the control plane's when `failed()` (or setting
    up failed), and it fails when the nodes left anything behind on the machine. Raises
    ControlPlaneBuildError when it cannot be built."""
    cp = ControlPlane(build_control_plane(), run_pods=True)
    failing, nodes = True, None
    try:
        cp.start()
        nodes = cp.nodes
        yield cp
        failing = failed()
    finally:
        cp.stop(failed=failing)
    assert nodes is not None and nodes.leftovers() == [], f"the node left things behind: {nodes.leftovers()}"


@contextmanager
def pod_cluster(failed: Callable[[], bool]) -> Iterator[SimpleNamespace]:
    """`real_cluster` with one node and MODEL on it, as (cp, node, root: the node's filesystem root,
    this machine's); the host paths pods write are restored afterwards."""
    with host_paths_restored(), real_cluster(failed) as cp:
        (node,) = cp.add_gpu_nodes(1)
        node_model(MODEL_DIR, arch="llama", params="1M", dtype="bfloat16")
        yield SimpleNamespace(cp=cp, node=node, root=Path("/"))


def node_model(directory: str, **make_model_args: Any) -> Path:
    """A random-weight checkpoint at `directory` on the node, readable by the runtime's user as a node's
    model files are."""
    from keepwarm_runtime.modelgen import make_model

    model = make_model(Path(directory), **make_model_args)
    for path in model.iterdir():
        path.chmod(0o644)
    return model


@contextmanager
def host_paths_restored() -> Iterator[None]:
    """Remove, at the end, what appeared meanwhile under HOST_PATHS (the folders themselves if new)."""
    before = {root: set(root.iterdir()) if root.is_dir() else None for root in HOST_PATHS}
    try:
        yield
    finally:
        for root, existing in before.items():
            if existing is None:
                shutil.rmtree(root, ignore_errors=True)
                continue
            for path in set(root.iterdir()) - existing if root.is_dir() else ():
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


# -- what a user applies ----------------------------------------------------------------------------


def install_chart(cp: ControlPlane) -> dict[str, Any]:
    """`helm install` of charts/keepwarm with one operator replica; returns the operator pod, Ready."""
    with helm.Config(kubeconfig_path=str(cp.kubeconfig), namespace=NAMESPACE) as cfg:
        release = cfg.install(CHART, RELEASE, {"replicaCount": 1}, create_namespace=True, timeout=120)
    assert release["name"] == RELEASE
    (operator,) = cp.wait_for(
        lambda: ready_pods(cp, NAMESPACE, OPERATOR, 1), timeout_s=180, what="the operator pod Ready"
    )
    return operator


def host_weightcache(name: str, **agent: Any) -> dict[str, Any]:
    """A host-tier WeightCache keeping MODEL (pinned) warm; `agent` adds to spec.agent."""
    return {
        "apiVersion": "keepwarm.dev/v1alpha1",
        "kind": "WeightCache",
        "metadata": {"name": name},
        "spec": {
            "tier": "host",
            "agent": {"image": RUNTIME_IMAGE, "gpuAccess": {"mode": "None"}, **agent},
            "models": [{"name": MODEL, "source": {"path": MODEL_DIR}, "pin": True}],
        },
    }


def cpu_inference_deployment(name: str, namespace: str, cache: str, replicas: int) -> dict[str, Any]:
    """An InferenceDeployment of MODEL from `cache` on CPU pods, small enough for the test box."""
    return {
        "apiVersion": "keepwarm.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": {"cacheRef": cache, "name": MODEL},
            "replicas": replicas,
            "gpusPerPod": 0,
            "image": RUNTIME_IMAGE,
            "runtime": {"maxModelLen": 256, "extraArgs": ["--num-kv-blocks", "64"]},
        },
    }


def children(pid: int) -> list[int]:
    """A host process's children (from /proc)."""
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def serving_chain(pid1: int) -> tuple[int, int]:
    """(the supervising parent, its serving worker) in a runtime container whose PID 1 is ``pid1``.
    PID 1 is the parent itself when it imported; when it was restored from a snapshot, PID 1 is the
    launcher and the restored parent its child (docs/snapshots.md). The worker ends the chain of only
    children; under --no-supervise PID 1 serves alone and is both."""
    chain = [pid1]
    while len(kids := children(chain[-1])) == 1:
        chain.append(kids[0])
    return (chain[-2] if len(chain) > 1 else pid1), chain[-1]


def snapshot_startup_label() -> str:
    """The namespace label the chart's tenancy policy asks of spec.startup.mode Snapshot (its values)."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    return values["tenancyPolicy"]["snapshotStartupNamespaceLabel"]


def create_namespace(cp: ControlPlane, name: str, snapshot_startup: bool = False) -> None:
    """A namespace; with `snapshot_startup`, labelled so its InferenceDeployments may use mode Snapshot."""
    cp.kubectl("create", "namespace", name)
    if snapshot_startup:
        cp.kubectl("label", "namespace", name, f"{snapshot_startup_label()}=true")


def apply(cp: ControlPlane, obj: dict[str, Any]) -> None:
    cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(obj))


# -- looking at the cluster -------------------------------------------------------------------------


def weightcache_nodes(cp: ControlPlane, cache: str) -> list[dict[str, Any]]:
    return items(cp, f"{GROUP_PATH}/weightcachenodes?labelSelector=keepwarm.dev/weightcache={cache}")


def lists_resident(wcn: dict[str, Any] | None, model: str = MODEL) -> bool:
    """The WeightCacheNode lists `model` Resident, whatever its phase."""
    models = ((wcn or {}).get("status") or {}).get("models", [])
    return any(m["name"] == model and m["state"] == "Resident" for m in models)


def is_resident(wcn: dict[str, Any] | None, model: str = MODEL) -> bool:
    """The WeightCacheNode says Ready with `model` Resident."""
    return ((wcn or {}).get("status") or {}).get("phase") == "Ready" and lists_resident(wcn, model)


def resident_node(cp: ControlPlane, cache: str) -> dict[str, Any] | None:
    """The cache's one WeightCacheNode once it is Ready with MODEL Resident, else None."""
    (wcn,) = weightcache_nodes(cp, cache) or [None]
    return wcn if is_resident(wcn) else None


def agent_selector(cache: str) -> str:
    return f"app.kubernetes.io/name=keepwarm-agent,app.kubernetes.io/instance={cache}"


def runtime_selector(idep: str) -> str:
    return f"app.kubernetes.io/name=keepwarm-runtime,app.kubernetes.io/instance={idep}"


def pods(cp: ControlPlane, namespace: str, selector: str) -> list[dict[str, Any]]:
    return items(cp, f"/api/v1/namespaces/{namespace}/pods?labelSelector={selector}")


def is_ready(pod: dict[str, Any]) -> bool:
    return condition(pod, "Ready").get("status") == "True" and not pod["metadata"].get("deletionTimestamp")


def ready_pods(cp: ControlPlane, namespace: str, selector: str, count: int) -> list[dict[str, Any]] | None:
    found = [p for p in pods(cp, namespace, selector) if is_ready(p)]
    return found if len(found) == count else None


# -- asking pods ------------------------------------------------------------------------------------


def client(pod: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://{pod['status']['podIP']}:8000/v1", api_key="x", max_retries=0, timeout=120
    )


def answer(pod: dict[str, Any]) -> str:
    out = client(pod).chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=8, temperature=0)
    return out.choices[0].message.content or ""


def metric(pod: dict[str, Any], name: str, label: str = "source") -> dict[str, float]:
    """The samples of `name` on a runtime pod's /metrics, by their `label` label."""
    text = httpx.get(f"http://{pod['status']['podIP']}:8000/metrics", timeout=30).text
    return {s.labels.get(label, ""): s.value for s in samples(text, name)}


def agent_metrics(pod: dict[str, Any]) -> str:
    """An agent pod's /metrics (its cache daemon's), on the port its container names ``metrics``."""
    port = next(p["containerPort"] for p in pod["spec"]["containers"][0]["ports"] if p["name"] == "metrics")
    return httpx.get(f"http://{pod['status']['podIP']}:{port}/metrics", timeout=30).text


def sample_sum(text: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples in a /metrics text that carry every one of ``labels``."""
    return sum(s.value for s in samples(text, name) if labels.items() <= s.labels.items())
