"""The node agent as it runs in the DaemonSet: `keepwarm cache serve --report-to-kubernetes` in a real
process, with the agent ServiceAccount's token (the RBAC the operator grants it), on a real API server.
It follows the WeightCache's model list (load, evict) and reports the WeightCacheNode status."""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid

import pytest
import yaml

from keepwarm_operator.builders.agent import agent_rbac
from keepwarm_runtime.cache.launcher import serve_command
from keepwarm_testing.operator import GROUP_PATH, NAMESPACE, ROOT, get, install_crds, wait

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_cache_serve_reports_and_follows_the_weightcache(control_plane, tiny_llama, tmp_path):
    cp = control_plane
    install_crds(cp)
    cache = f"agent{uuid.uuid4().hex[:5]}"
    (node,) = cp.add_gpu_nodes(1, prefix=cache)
    models = tmp_path / "models"
    for name in ("alpha", "beta"):
        shutil.copytree(tiny_llama, models / name)
    first = [{"name": "alpha", "source": {"path": "/x"}}, {"name": "gamma", "source": {"path": "/z"}}]
    spec = {"tier": "host", "heartbeatSeconds": 1, "models": first}  # gamma's files are not there yet
    wc = {
        "apiVersion": "keepwarm.dev/v1alpha1",
        "kind": "WeightCache",
        "metadata": {"name": cache},
        "spec": spec,
    }
    wcn = {
        "apiVersion": "keepwarm.dev/v1alpha1",
        "kind": "WeightCacheNode",
        "metadata": {"name": f"{cache}.{node}"},
        "spec": {"weightCache": cache, "nodeName": node},
    }  # what the operator creates once the agent pod is bound
    cp.kubectl("create", "namespace", NAMESPACE, check=False)
    docs = [wc, wcn, *agent_rbac(cache, NAMESPACE, None)]
    cp.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump_all(docs))
    # The agent's token is bound to a pod of its ServiceAccount on the node, as a kubelet would mount it.
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"keepwarm-agent-{cache}", "namespace": NAMESPACE},
        "spec": {
            "nodeName": node,
            "serviceAccountName": f"keepwarm-agent-{cache}",
            "containers": [{"name": "agent", "image": "keepwarm-runtime"}],
        },
    }
    cp.kubectl("apply", "-f", "-", input=json.dumps(pod))
    bound = get(cp, f"/api/v1/namespaces/{NAMESPACE}/pods/keepwarm-agent-{cache}")
    agent_kc = cp.service_account_kubeconfig(
        NAMESPACE, f"keepwarm-agent-{cache}", create=False, bound_pod=bound
    )
    env = {**cp.env(agent_kc), "KEEPWARM_MODEL_ROOT": str(models)}
    cmd = serve_command(
        tmp_path / "sock", [], "--dtype", "bfloat16", "--report-to-kubernetes",
        "--weightcache", cache, "--node-name", node,
    )  # fmt: skip
    log = tmp_path / "agent.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    try:

        def resident(*names):
            status = (get(cp, f"{GROUP_PATH}/weightcachenodes/{cache}.{node}") or {}).get("status") or {}
            states = {m["name"]: m["state"] for m in status.get("models", [])}
            return status.get("phase") == "Ready" and states == dict.fromkeys(names, "Resident") and status

        def states():
            status = (get(cp, f"{GROUP_PATH}/weightcachenodes/{cache}.{node}") or {}).get("status") or {}
            return {m["name"]: m["state"] for m in status.get("models", [])}

        wait(
            cp,
            lambda: states() == {"alpha": "Resident", "gamma": "Failed"},
            f"alpha resident, gamma failed (agent log {log})",
            timeout_s=120,
        )
        shutil.copytree(tiny_llama, models / "gamma")  # the fault goes away; nobody touches the spec
        status = wait(
            cp, lambda: resident("alpha", "gamma"), f"gamma retried by itself (agent log {log})", timeout_s=90
        )
        assert status["totalBytes"] > 0 and status["models"][0]["fingerprint"] and status["agentVersion"]
        patch = {"spec": {"models": [{"name": "beta", "source": {"path": "/y"}, "pin": True}]}}
        cp.kubectl("patch", "wc", cache, "--type=merge", "-p", json.dumps(patch))
        status = wait(
            cp, lambda: resident("beta"), f"alpha evicted, beta resident (agent log {log})", timeout_s=60
        )
        assert status["models"][0]["pinned"] is True
        assert proc.poll() is None, log.read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        cp.kubectl("delete", "pod", f"keepwarm-agent-{cache}", "-n", NAMESPACE, "--wait=false", check=False)
        cp.remove_node(node)
        cp.kubectl("delete", "wcn", f"{cache}.{node}", check=False)
        cp.kubectl("delete", "wc", cache, check=False)
        agent = f"keepwarm-agent-{cache}"
        cp.kubectl("delete", "clusterrole,clusterrolebinding", agent, check=False)
        cp.kubectl("delete", "serviceaccount", agent, "-n", NAMESPACE, check=False)
