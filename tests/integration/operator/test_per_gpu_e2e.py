"""Per-GPU residency end to end: the operator, a real agent process with four fake GPUs, a real API
server. The agent runs `keepwarm cache serve` as the DaemonSet's command does (gpu tier, --all-gpus)
plus the test twin `--fake-gpu` x4: one host-memory daemon per fake GPU on gpu-<UUID>.sock. Its
WeightCacheNode reports each GPU; the node is warm while all four hold the model, and when one GPU
loses it (released there, its files gone so the reload fails) that GPU is reported so and the warm
label goes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid

import httpx
import pytest
import yaml

from keepwarm_operator.builders.meta import warm_label_key
from keepwarm_runtime.cache.launcher import serve_command
from keepwarm_runtime.server.launcher import free_port
from keepwarm_testing.operator import (
    GROUP_PATH,
    NAMESPACE,
    ROOT,
    OperatorProcess,
    condition,
    get,
    install_chart_rbac,
    install_crds,
    items,
    samples,
    wait,
)

pytestmark = pytest.mark.slow
MODEL = "tiny"


def test_four_fake_gpus_report_per_gpu_and_warm_only_when_all_hold_it(control_plane, tiny_llama, tmp_path):
    cp = control_plane
    install_crds(cp)
    install_chart_rbac(cp)
    runtime_class = {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": "nvidia"}}
    cp.kubectl("apply", "-f", "-", input=yaml.safe_dump({**runtime_class, "handler": "nvidia"}))
    cache = f"pergpu{uuid.uuid4().hex[:5]}"
    gpus = [f"GPU-{cache}-{i}" for i in range(4)]
    (node,) = cp.add_gpu_nodes(1, labels={"pool": cache}, gpus=4, prefix=cache)
    models = tmp_path / "models"
    shutil.copytree(tiny_llama, models / MODEL)
    op = OperatorProcess(cp, tmp_path).start()
    wc = {
        "apiVersion": "keepwarm.dev/v1alpha1",
        "kind": "WeightCache",
        "metadata": {"name": cache},
        "spec": {
            "tier": "gpu",
            "nodeSelector": {"pool": cache},
            "heartbeatSeconds": 1,
            "models": [{"name": MODEL, "source": {"path": f"/var/lib/models/{MODEL}"}, "pin": True}],
        },
    }
    cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(wc))
    wcn_path = f"{GROUP_PATH}/weightcachenodes/{cache}.{node}"
    agent_pods = f"/api/v1/namespaces/{NAMESPACE}/pods?labelSelector=keepwarm.dev/weightcache={cache}"
    wait(cp, lambda: get(cp, wcn_path) and items(cp, agent_pods), "agent pod and WeightCacheNode", op=op)
    (pod,) = items(cp, agent_pods)
    command = pod["spec"]["containers"][0]["command"]
    assert "--all-gpus" in command and command[command.index("--tier") + 1] == "gpu"
    agent_kc = cp.service_account_kubeconfig(
        NAMESPACE, f"keepwarm-agent-{cache}", create=False, bound_pod=pod
    )
    fake = [arg for u in gpus for arg in ("--fake-gpu", u)]
    metrics_port = free_port()
    cmd = serve_command(
        tmp_path / "sock", [], "--dtype", "bfloat16", "--all-gpus", *fake, "--report-to-kubernetes",
        "--weightcache", cache, "--node-name", node, "--metrics-port", str(metrics_port), tier="gpu",
    )  # fmt: skip
    env = {**cp.env(agent_kc), "KEEPWARM_HOST_MODEL_ROOT": str(models), "POD_NAMESPACE": NAMESPACE}
    log = tmp_path / "agent.log"
    warm = warm_label_key(cache, MODEL)

    def status() -> dict:
        return (get(cp, wcn_path) or {}).get("status") or {}

    def per_gpu() -> dict[str, dict[str, str]]:
        return {
            g["uuid"]: {m["name"]: m["state"] for m in g.get("models", [])} for g in status().get("gpus", [])
        }

    def labels() -> dict[str, str]:
        return get(cp, f"/api/v1/nodes/{node}")["metadata"].get("labels", {})

    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        everywhere = {u: {MODEL: "Resident"} for u in gpus}
        wait(cp, lambda: per_gpu() == everywhere, f"resident on all 4 GPUs (agent log {log})", 120, op)
        s = status()
        assert s["gpuUuids"] == sorted(gpus) and s["phase"] == "Ready"
        (model,) = s["models"]
        assert model["state"] == "Resident" and model["gpuUuids"] == sorted(gpus)
        assert sorted(p.name for p in (tmp_path / "sock").glob("*.sock")) == sorted(
            f"gpu-{u}.sock" for u in gpus
        )
        # One /metrics (the readinessProbe's) for the four daemons, each sample naming its GPU.
        page = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
        resident = samples(page, "keepwarm_cache_resident_bytes")
        assert sorted(x.labels["gpu"] for x in resident) == sorted(gpus) and all(
            x.value > 0 for x in resident
        )
        wait(cp, lambda: labels().get(warm) == "true", "the node labelled warm", op=op)
        wait(
            cp,
            lambda: (
                (get(cp, f"{GROUP_PATH}/weightcaches/{cache}") or {}).get("status", {}).get("readyNodes") == 1
            ),
            "the WeightCache counting the node ready",
            op=op,
        )
        # The agent's GPU count is compared with what the Node offers pods: equal here (4 and 4) ...
        wc_path = f"{GROUP_PATH}/weightcaches/{cache}"
        assert condition(get(cp, wc_path), "GPUsMatch").get("status") == "True"

        def offer(n: int) -> None:
            patch = {
                "status": {"capacity": {"nvidia.com/gpu": str(n)}, "allocatable": {"nvidia.com/gpu": str(n)}}
            }
            cp.kubectl("patch", "node", node, "--subresource=status", "--type=merge", "-p", json.dumps(patch))

        def gpus_match() -> dict:
            return condition(get(cp, wc_path), "GPUsMatch")

        offer(8)  # ... and named once the Node offers 8 GPUs the agent does not see (next resync)
        wait(cp, lambda: gpus_match().get("reason") == "GPUCountMismatch", "GPUsMatch=False", op=op)
        assert gpus_match()["status"] == "False"
        assert gpus_match()["message"] == f"{node}: agent sees 4 GPU(s), Node allocatable nvidia.com/gpu is 8"
        offer(4)
        wait(cp, lambda: gpus_match().get("status") == "True", "GPUsMatch=True again", op=op)
        # GPU 3 loses the model and cannot load it again: reported on that GPU, and the node is not warm.
        (models / MODEL).rename(models / "moved")
        release = [
            sys.executable, "-m", "keepwarm_runtime.cli", "cache", "release", "--force",
            "--socket", str(tmp_path / "sock" / f"gpu-{gpus[3]}.sock"), MODEL,
        ]  # fmt: skip
        subprocess.run(release, check=True, capture_output=True, timeout=60)

        def missing_on_gpu3() -> bool:
            states = per_gpu()
            return states.get(gpus[3], {}).get(MODEL) in ("Evicted", "Failed") and all(
                states[u] == {MODEL: "Resident"} for u in gpus[:3]
            )

        wait(cp, missing_on_gpu3, f"GPU 3 reported without the model (agent log {log})", 60, op)
        (model,) = status()["models"]
        assert model["state"] in ("Evicted", "Failed") and model["message"].startswith(f"{gpus[3]}: ")
        assert model["gpuUuids"] == sorted(gpus[:3])
        wait(cp, lambda: warm not in labels(), "the warm label removed", op=op)
        wait(
            cp,
            lambda: (
                condition(get(cp, f"{GROUP_PATH}/weightcaches/{cache}"), "Ready").get("status") == "False"
            ),
            "the WeightCache no longer Ready",
            op=op,
        )
        assert proc.poll() is None, log.read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        cp.kubectl("delete", "wc", cache, "--wait=false", check=False)
        op.stop()
        cp.remove_node(node)
