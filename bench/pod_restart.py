"""A pod restart as a user sees it, on real pods: from `kubectl delete pod`, a crash, and scale 0 -> 1.

    flock /tmp/kw-bench.lock .venv/bin/python bench/pod_restart.py [--params 500M,1B] [--json-out FILE]

Needs root: two real nodes on this machine (keepwarm_testing.node: the kubelet on containerd and runc,
the Dockerfile's images pulled from a registry on loopback); `helm install` of the chart; a host-tier
WeightCache selecting one node only (the warm node), with its process snapshot store on; the model
generated under modelDirectory (both nodes' filesystem is this machine's). Per mode, one
InferenceDeployment of one replica: `warm` attaches through the cache (cacheRef), `snapshot` too and
restores its supervising parent from the warm node's snapshot (spec.startup.mode Snapshot, after the
first pod's snapshot is taken: docs/snapshots.md), `cold` names the same directory as its own source
(no cache: weights from disk). Before every case the checkpoint's files are evicted from
the page cache (posix_fadvise DONTNEED on each file: a node whose disk cache does not hold the
weights, while the image's own files stay cached as on a node that ran the image before).
Per case the clock starts at the action and stops at the new pod's Ready (polled every 50 ms) and at
its first token (the official `openai` client, polling after Ready; it has served a request before the
clock starts, so the figure holds no first-use cost of the client library). One JSON object:
  runs[]: size_params, size_gib, case (delete | crash | scale_from_zero), mode (warm | snapshot |
          cold), node
          (where the new pod landed), pod_ready_s, first_token_s, container_start_s (the action to
          the new container's first process: scheduling, the kubelet, the sandbox, CNI, runc),
          parent_imports_s (that process's start to its serving worker's fork: the supervising
          parent's imports, or in mode snapshot its restore and what the restored parent does
          before it forks),
          process_ready_s (the worker's fork to ready, keepwarm_process_start_to_ready_seconds),
          ready_lag_s (pod Ready minus the worker's ready instant: what probes and the kubelet add),
          phases (keepwarm_startup_phase_seconds), startup_source (keepwarm_startup_source_total's
          source and reason: snapshot/hit, or imports/why), restore_s (the pod's start until the
          restored parent resumed: the phase `restore`; null when it imported),
          first_request_server_s (the first token's request from its arrival in the server to its
          end: keepwarm_e2e_request_latency_seconds; the rest of first_token_s - pod_ready_s is the
          client, the network and the poll), restore_parts (from the launcher's log: launcher_s, its
          own start and key; criu_s; page_digests_s, beside CRIU's; empty when it imported).
          Instants are on the boot clock, to 10 ms.
A benchmark, not a test: nothing here asserts speed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import helm_python as helm
import httpx
import openai
import yaml

from keepwarm_runtime.bench_cli import publish
from keepwarm_testing.controlplane.build import build_control_plane
from keepwarm_testing.controlplane.cluster import ControlPlane
from keepwarm_testing.e2e import (
    RUNTIME_IMAGE,
    create_namespace,
    host_paths_restored,
    node_model,
    serving_chain,
)
from keepwarm_testing.operator import CHART, GROUP_PATH, NAMESPACE, RELEASE, condition, items, samples

WC, APPS, MODEL_DIR, POLL_S = "bench", "bench-apps", "/var/lib/models/bench", 0.05
CLK_TCK = os.sysconf("SC_CLK_TCK")


def clock() -> float:
    """Seconds since boot: the clock /proc's process start times count in (to 1/CLK_TCK), so a
    process's start and this script's instants compare without btime's whole-second rounding."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def process_start(pid: int) -> float:
    """A host process's start on clock() (from /proc: clock ticks since boot)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[19]) / CLK_TCK


def runtime_pods(cp: ControlPlane, name: str) -> list[dict[str, Any]]:
    selector = f"app.kubernetes.io/name=keepwarm-runtime,app.kubernetes.io/instance={name}"
    return items(cp, f"/api/v1/namespaces/{APPS}/pods?labelSelector={selector}")


def ready(pod: dict[str, Any]) -> bool:
    return condition(pod, "Ready").get("status") == "True" and not pod["metadata"].get("deletionTimestamp")


def wait(predicate: Any, timeout_s: float = 900.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if value := predicate():
                return value
        except httpx.HTTPError:  # e.g. 429 while the API server initializes a new CRD's storage
            pass
        time.sleep(POLL_S)
    raise TimeoutError(f"gave up after {timeout_s:.0f} s")


def first_token(pod: dict[str, Any], model: str) -> None:
    client = openai.OpenAI(base_url=f"http://{pod['status']['podIP']}:8000/v1", api_key="x", max_retries=0)
    while True:
        try:
            client.completions.create(model=model, prompt="Hello", max_tokens=1)
            return
        except openai.APIError:
            time.sleep(POLL_S)


def evict_from_page_cache(model_dir: Path) -> None:
    """Drop the checkpoint's pages from the page cache (clean pages: no root needed)."""
    for path in model_dir.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def size_gib(model_dir: Path) -> float:
    return round(sum(p.stat().st_size for p in model_dir.glob("*.safetensors")) / 2**30, 3)


def runtime_metrics(pod: dict[str, Any]) -> tuple[float, dict[str, float], str, float]:
    """The serving worker's fork-to-ready, its startup phases, how its parent came up, and the time
    its requests so far (the first token's) spent in it."""
    text = httpx.get(f"http://{pod['status']['podIP']}:8000/metrics", timeout=30).text
    ready_s = samples(text, "keepwarm_process_start_to_ready_seconds")[0].value
    phases = {s.labels["phase"]: round(s.value, 3) for s in samples(text, "keepwarm_startup_phase_seconds")}
    sources = [s.labels for s in samples(text, "keepwarm_startup_source_total") if s.value > 0]
    in_server = samples(text, "keepwarm_e2e_request_latency_seconds_sum")[0].value
    return ready_s, phases, ",".join(f"{s['source']}/{s['reason']}" for s in sources), in_server


RESTORED = re.compile(r"snapshots: restored \S+ as pid \d+, [\d.]+s after this process started \(([\d.]+)s")
CRIU = re.compile(r"snapshots: criu restore ([\d.]+)s, page digests ([\d.]+)s beside it")


def restore_parts(cp: ControlPlane, pod: dict[str, Any]) -> dict[str, float]:
    """What the pod's launcher logged of its restore: its own start and key (``launcher_s``), CRIU's
    restore and the page digests beside it; empty when it imported."""
    log = cp.kubectl("logs", "-n", APPS, pod["metadata"]["name"]).stdout
    parts = {}
    if found := RESTORED.search(log):
        parts["launcher_s"] = float(found[1])
    if found := CRIU.search(log):
        parts["criu_s"], parts["page_digests_s"] = float(found[1]), float(found[2])
    return parts


def measure(
    cp: ControlPlane, name: str, case: str, mode: str, params: str, models: list[Path]
) -> dict[str, Any]:
    # The previous case's pod may still be in its preStop sleep: the one this case acts on is Ready.
    (old,) = wait(lambda: [p for p in runtime_pods(cp, name) if ready(p)] or None)
    wait(lambda: len(runtime_pods(cp, name)) == 1)  # and the previous one gone, so cases never overlap
    restarts = old["status"]["containerStatuses"][0]["restartCount"]
    # A client that has served before, as a user's has: this process's first request pays the
    # openai package's lazy imports and first connection (0.3-0.4 s here), which no pod causes.
    first_token(old, "tiny")
    if case == "scale_from_zero":
        cp.kubectl("scale", "-n", APPS, f"inferencedeployment/{name}", "--replicas=0")
        wait(lambda: not runtime_pods(cp, name))
    for model in models:
        evict_from_page_cache(model)
    t0 = clock()
    if case == "delete":
        cp.kubectl("delete", "pod", "-n", APPS, old["metadata"]["name"], "--wait=false")
    elif case == "crash":
        os.kill(cp.nodes.container_pid(old), signal.SIGKILL)
    else:
        cp.kubectl("scale", "-n", APPS, f"inferencedeployment/{name}", "--replicas=1")

    def new_ready() -> dict[str, Any] | None:
        for pod in runtime_pods(cp, name):
            status = (pod.get("status", {}).get("containerStatuses") or [{}])[0]
            fresh = (
                pod["metadata"]["uid"] != old["metadata"]["uid"] or status.get("restartCount", 0) > restarts
            )
            if fresh and ready(pod):
                return pod
        return None

    pod = wait(new_ready)
    pod_ready = clock()
    first_token(pod, "tiny")
    token = clock()
    process_ready_s, phases, source, first_request_server_s = runtime_metrics(pod)
    pid1 = cp.nodes.container_pid(pod)
    # The worker reports keepwarm_process_start_to_ready_seconds from its own start (e2e.serving_chain)
    started, serving_started = process_start(pid1), process_start(serving_chain(pid1)[1])
    runtime_ready = serving_started + process_ready_s
    return {
        "size_params": params, "size_gib": size_gib(models[0]), "case": case, "mode": mode,
        "node": pod["spec"]["nodeName"], "pod_ready_s": round(pod_ready - t0, 3),
        "first_token_s": round(token - t0, 3), "container_start_s": round(started - t0, 3),
        "parent_imports_s": round(serving_started - started, 3),
        "process_ready_s": round(process_ready_s, 3), "ready_lag_s": round(pod_ready - runtime_ready, 3),
        "phases": phases, "startup_source": source, "restore_s": phases.get("restore"),
        "first_request_server_s": round(first_request_server_s, 3), "restore_parts": restore_parts(cp, pod),
    }  # fmt: skip


def deployment(name: str, mode: str) -> dict[str, Any]:
    model = (
        {"name": "tiny", "source": {"path": MODEL_DIR}}
        if mode == "cold"
        else {"cacheRef": WC, "name": "tiny"}
    )
    startup = {"mode": "Snapshot" if mode == "snapshot" else "Imports"}
    return {
        "apiVersion": "keepwarm.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": name, "namespace": APPS},
        "spec": {
            "model": model,
            "replicas": 1,
            "gpusPerPod": 0,
            "image": RUNTIME_IMAGE,
            "runtime": {"maxModelLen": 256},
            "startup": startup,
        },
    }


def snapshots_on(cp: ControlPlane, node: str) -> list[dict[str, Any]]:
    """The snapshots the node's WeightCacheNode reports (status.snapshots)."""
    wcns = items(cp, f"{GROUP_PATH}/weightcachenodes?labelSelector=keepwarm.dev/weightcache={WC}")
    return [
        s for w in wcns if w["spec"].get("nodeName") == node for s in w.get("status", {}).get("snapshots", [])
    ]


def run(params: str, cases: list[str], modes: list[str]) -> dict[str, Any]:
    runs = []
    with host_paths_restored(), ControlPlane(build_control_plane(), run_pods=True) as cp:
        (warm_node,) = cp.add_gpu_nodes(1, labels={"bench-cache": "on"})
        cp.add_gpu_nodes(1)  # the cold node: the cache's nodeSelector leaves it out
        models = [node_model(MODEL_DIR, params=params)]  # one machine: both nodes see these files
        with helm.Config(kubeconfig_path=str(cp.kubeconfig), namespace=NAMESPACE) as cfg:
            cfg.install(CHART, RELEASE, {"replicaCount": 1}, create_namespace=True, timeout=300)
        cache_spec = {
            "tier": "host",
            "nodeSelector": {"bench-cache": "on"},
            "agent": {"image": RUNTIME_IMAGE, "gpuAccess": {"mode": "None"}},
            "models": [{"name": "tiny", "source": {"path": MODEL_DIR}, "pin": True}],
            "snapshots": {"enabled": "snapshot" in modes},
        }
        cache = {"apiVersion": "keepwarm.dev/v1alpha1", "kind": "WeightCache", "metadata": {"name": WC}}
        cache["spec"] = cache_spec
        cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(cache))

        def resident() -> bool:
            wcns = items(cp, f"{GROUP_PATH}/weightcachenodes?labelSelector=keepwarm.dev/weightcache={WC}")
            models = [m for w in wcns for m in (w.get("status") or {}).get("models", [])]
            return any(m["state"] == "Resident" for m in models)

        wait(resident)
        create_namespace(cp, APPS, snapshot_startup="snapshot" in modes)
        for mode in modes:
            name = f"bench-{mode}"
            cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(deployment(name, mode)))
            wait(lambda name=name: [p for p in runtime_pods(cp, name) if ready(p)])
            if mode == "snapshot":  # the first pod imported and asked for one: taken beside it
                wait(lambda: snapshots_on(cp, warm_node))
            for case in cases:
                runs.append(measure(cp, name, case, mode, params, models))
                print(json.dumps(runs[-1]), file=sys.stderr)
            cp.kubectl("delete", "-n", APPS, "inferencedeployment", name, "--wait=true", timeout=300)
            wait(lambda name=name: not runtime_pods(cp, name))
    return {"runs": runs, "warm_node": warm_node, "load_avg": os.getloadavg(), "cpus": os.cpu_count()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--params", default="1M", help="model sizes for keepwarm_runtime.modelgen, comma-separated (500M,1B)"
    )
    parser.add_argument("--cases", default="delete,crash,scale_from_zero")
    parser.add_argument("--modes", default="warm,snapshot,cold")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        sys.exit("bench/pod_restart.py runs pods for real: it needs root")
    sizes = [run(params, args.cases.split(","), args.modes.split(",")) for params in args.params.split(",")]
    result = {**sizes[-1], "runs": [r for size in sizes for r in size["runs"]]}
    publish(result, args.json_out)


if __name__ == "__main__":
    main()
