"""Scale run (a benchmark, not a test): 100 fake GPU nodes, one WeightCache on all of them, 200
InferenceDeployments; prints JSON with the operator's reaction latency p50/p99 and its memory.

    .venv/bin/python -m tests.integration.operator.bench_scale [--nodes 100] [--ideps 200]

Latency per InferenceDeployment, measured from this client: create -> its Deployment exists
("reconcile"), and create -> status Available=True ("available", includes scheduling and the fake
kubelet). Memory: the operator process's peak RSS (VmHWM) and RSS at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

from tests.controlplane.build import build_control_plane
from tests.controlplane.cluster import ControlPlane
from tests.integration.operator.harness import (
    GROUP_PATH,
    OperatorProcess,
    condition,
    install_chart_rbac,
    install_crds,
    items,
)


def _rss(pid: int) -> dict[str, float]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            fields[key] = int(value.split()[0]) / 1024  # MiB
    return fields


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--ideps", type=int, default=200)
    parser.add_argument("--resync-seconds", type=float, default=30.0)
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args()
    t0 = time.perf_counter()
    with ControlPlane(build_control_plane()) as cp:
        startup_s = time.perf_counter() - t0
        install_crds(cp)
        install_chart_rbac(cp)
        nodes = cp.add_gpu_nodes(args.nodes, labels={"pool": "scale"}, prefix="scale", gpus=8)
        op = OperatorProcess(cp, Path(tempfile.mkdtemp()), resync_s=args.resync_seconds).start()
        try:
            cache = {
                "apiVersion": "keepwarm.dev/v1alpha1",
                "kind": "WeightCache",
                "metadata": {"name": "scale"},
                "spec": {
                    "tier": "host",
                    "nodeSelector": {"pool": "scale"},
                    "heartbeatSeconds": 600,
                    "models": [{"name": "m", "source": {"path": "/models/m"}}],
                },
            }
            cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(cache))
            cp.kubectl("create", "namespace", "scale")
            created: dict[str, float] = {}
            docs = []
            for i in range(args.ideps):
                docs.append(
                    {
                        "apiVersion": "keepwarm.dev/v1alpha1",
                        "kind": "InferenceDeployment",
                        "metadata": {"name": f"m{i:03d}", "namespace": "scale"},
                        "spec": {"model": {"cacheRef": "scale", "name": "m"}, "replicas": 1, "gpusPerPod": 1},
                    }
                )
            reconciled: dict[str, float] = {}
            available: dict[str, float] = {}
            done = threading.Event()

            def poll() -> None:  # first-seen times, measured while the batches are still being applied
                while not done.is_set():
                    now = time.perf_counter()
                    for d in items(cp, "/apis/apps/v1/namespaces/scale/deployments"):
                        reconciled.setdefault(d["metadata"]["name"], now)
                    for obj in items(cp, f"{GROUP_PATH}/namespaces/scale/inferencedeployments"):
                        if condition(obj, "Available").get("status") == "True":
                            available.setdefault(obj["metadata"]["name"], now)
                    time.sleep(0.25)

            poller = threading.Thread(target=poll, daemon=True)
            poller.start()
            for i in range(0, len(docs), 20):  # batches of 20, as a CI pipeline would apply them
                stamp = time.perf_counter()  # before: the operator may react while kubectl still runs
                cp.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs[i : i + 20]))
                for d in docs[i : i + 20]:
                    created[d["metadata"]["name"]] = stamp
            deadline = time.perf_counter() + args.timeout
            while len(available) < args.ideps and time.perf_counter() < deadline:
                time.sleep(0.5)
            done.set()
            poller.join()
            wc_ready = items(cp, f"{GROUP_PATH}/weightcachenodes")
            lat = [reconciled[n] - created[n] for n in reconciled]
            avail = [available[n] - created[n] for n in available]
            mem = _rss(op.proc.pid)
            result = {
                "nodes": len(nodes),
                "inference_deployments": args.ideps,
                "weightcachenodes": len(wc_ready),
                "control_plane_start_s": round(startup_s, 1),
                "reconciled": len(lat),
                "available": len(avail),
                "reconcile_latency_s": {
                    "p50": pct(lat, 0.5),
                    "p99": pct(lat, 0.99),
                    "max": round(max(lat), 3),
                }
                if lat
                else None,
                "available_latency_s": {"p50": pct(avail, 0.5), "p99": pct(avail, 0.99)} if avail else None,
                "mean_reconcile_s": round(statistics.mean(lat), 3) if lat else None,
                "operator_peak_rss_mib": round(mem.get("VmHWM", 0), 1),
                "operator_rss_mib": round(mem.get("VmRSS", 0), 1),
                "machine": "2-core CPU, shared",
            }
            print(json.dumps(result, indent=2))
        finally:
            op.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
