"""The node agent as it runs in the DaemonSet: `keepwarm cache serve --report-to-kubernetes` in a real
process, with the agent ServiceAccount's token (the RBAC the operator grants it), on a real API server.
It follows its WeightCacheNode's spec (load, evict; written here as the operator writes it), reads a
Hub token from a Secret through the API, and reports the WeightCacheNode status."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid

import pytest
import yaml

from keepwarm_api.weightcachenode import DAEMON_STARTED, PEERS_REFUSED
from keepwarm_operator.builders.agent import agent_rbac
from keepwarm_runtime.cache.launcher import serve_command
from keepwarm_testing.operator import (
    GROUP_PATH,
    NAMESPACE,
    ROOT,
    agent_pod_kubeconfig,
    get,
    install_crds,
    wait,
)

pytestmark = pytest.mark.slow
NOBODY = 65534
# A client of a uid the daemon does not allow: it connects and prints the daemon's answer (from inside
# the socket directory: the test's tmp_path above it is private to root).
FOREIGN_CLIENT = f"""
import os, socket, sys
os.chdir(sys.argv[1])
os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})
s = socket.socket(socket.AF_UNIX)
s.connect("host.sock")
print(s.recv(65536)[4:].decode(errors="replace"))
"""


def _remove_agent(cp, cache: str, node: str) -> None:
    """What an agent test leaves on the control plane: its pod, node, WeightCacheNode and RBAC."""
    cp.kubectl("delete", "pod", f"keepwarm-agent-{cache}", "-n", NAMESPACE, "--wait=false", check=False)
    cp.remove_node(node)
    cp.kubectl("delete", "wcn", f"{cache}.{node}", check=False)
    agent = f"keepwarm-agent-{cache}"
    cp.kubectl("delete", "clusterrole,clusterrolebinding", agent, check=False)
    cp.kubectl("delete", "serviceaccount,role,rolebinding", agent, "-n", NAMESPACE, check=False)


def test_cache_serve_reports_and_follows_the_weightcache(control_plane, tiny_llama, tmp_path):
    cp = control_plane
    install_crds(cp)
    cache = f"agent{uuid.uuid4().hex[:5]}"
    (node,) = cp.add_gpu_nodes(1, prefix=cache)
    models = tmp_path / "models"
    for name in ("alpha", "beta"):
        shutil.copytree(tiny_llama, models / name)
    hub = {
        "huggingFace": {"repo": "org/gated", "revision": "main", "tokenSecretRef": {"name": f"{cache}-hf"}}
    }
    first = [
        {"name": "alpha", "source": {"path": "/m/alpha"}},
        {"name": "gamma", "source": {"path": "/m/gamma"}},  # its files are not there yet
        {"name": "gated", "source": hub},  # the Hub (HF_ENDPOINT) refuses connections
    ]
    wcn = {
        "apiVersion": "keepwarm.dev/v1alpha1",
        "kind": "WeightCacheNode",
        "metadata": {"name": f"{cache}.{node}"},
        "spec": {
            "weightCache": cache,
            "nodeName": node,
            "modelDirectory": "/m",
            "heartbeatSeconds": 1,
            "models": first,
        },
    }  # what the operator creates once the agent pod is bound
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": f"{cache}-hf", "namespace": NAMESPACE},
        "stringData": {"token": "hf_e2e"},
    }
    cp.kubectl("create", "namespace", NAMESPACE, check=False)
    docs = [wcn, secret, *agent_rbac(cache, NAMESPACE, None, [f"{cache}-hf"])]
    cp.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump_all(docs))
    agent_kc = agent_pod_kubeconfig(cp, cache, node)
    env = {
        **cp.env(agent_kc),
        "KEEPWARM_HOST_MODEL_ROOT": str(models),  # the mount of modelDirectory /m
        "POD_NAMESPACE": NAMESPACE,
        "HF_ENDPOINT": "http://127.0.0.1:9",  # discard port: nothing listens
        "HF_HOME": str(tmp_path / "hf"),
    }
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

        def models_now():
            status = (get(cp, f"{GROUP_PATH}/weightcachenodes/{cache}.{node}") or {}).get("status") or {}
            return {m["name"]: m for m in status.get("models", [])}

        def states():
            return {name: m["state"] for name, m in models_now().items()}

        wait(
            cp,
            lambda: states() == {"alpha": "Resident", "gamma": "Failed", "gated": "Failed"},
            f"alpha resident, gamma and gated failed (agent log {log})",
            timeout_s=120,
        )
        gated = models_now()["gated"]
        # The token was read through the API (the Role names its Secret); the download itself failed.
        assert "tokenSecretRef" not in gated["message"] and gated["retryAt"], gated
        shutil.copytree(tiny_llama, models / "gamma")  # the fault goes away; nobody touches the spec
        wait(
            cp,
            lambda: (
                states()
                in ({"alpha": "Resident", "gamma": "Resident", "gated": s} for s in ("Failed", "Loading"))
            ),
            f"gamma retried by itself (agent log {log})",
            timeout_s=90,
        )
        status = get(cp, f"{GROUP_PATH}/weightcachenodes/{cache}.{node}")["status"]
        assert status["totalBytes"] > 0 and status["models"][0]["fingerprint"] and status["agentVersion"]
        wcn_path = f"{cache}.{node}"
        patch = {"spec": {"models": [{"name": "beta", "source": {"path": "/m/beta"}, "pin": True}]}}
        cp.kubectl("patch", "wcn", wcn_path, "--type=merge", "-p", json.dumps(patch))
        status = wait(
            cp, lambda: resident("beta"), f"alpha evicted, beta resident (agent log {log})", timeout_s=60
        )
        assert status["models"][0]["pinned"] is True
        # Steady now: heartbeats renew the node's Lease and leave the WeightCacheNode alone.
        lease_path = f"/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases/{cache}.{node}"
        lease = wait(cp, lambda: get(cp, lease_path), "the agent's Lease", timeout_s=30)
        steady = get(cp, f"{GROUP_PATH}/weightcachenodes/{cache}.{node}")["metadata"]["resourceVersion"]
        renewals = {lease["spec"]["renewTime"]}

        def renewed():
            at = get(cp, lease_path)["spec"]["renewTime"]
            return at if at not in renewals else None

        while len(renewals) < 3:  # two more renewals, a heartbeat (1 s) apart
            renewals.add(wait(cp, renewed, "a renewal", timeout_s=30))
        wcn_now = get(cp, f"{GROUP_PATH}/weightcachenodes/{cache}.{node}")["metadata"]["resourceVersion"]
        assert wcn_now == steady, "a steady agent wrote its WeightCacheNode"

        # A pod whose uid and groups the daemon does not allow loads from disk; the node says why.
        socket_dir = tmp_path / "sock"
        os.chmod(socket_dir, 0o777)
        os.chmod(socket_dir / "host.sock", 0o666)
        refused = subprocess.run(
            [sys.executable, "-c", FOREIGN_CLIENT, str(socket_dir)],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout  # fmt: skip
        assert '"forbidden"' in refused, refused

        def peers_refused():
            status = get(cp, f"{GROUP_PATH}/weightcachenodes/{cache}.{node}").get("status") or {}
            return next((c for c in status.get("conditions", []) if c["type"] == PEERS_REFUSED), None)

        cond = wait(cp, peers_refused, f"PeersRefused on the node (agent log {log})", timeout_s=30)
        assert cond["status"] == "True" and f"uid {NOBODY} with gids [{NOBODY}]" in cond["message"], cond
        assert proc.poll() is None, log.read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        _remove_agent(cp, cache, node)
        cp.kubectl("delete", "secret", f"{cache}-hf", "-n", NAMESPACE, check=False)


def test_a_daemon_that_cannot_start_says_why_on_its_node(control_plane, tiny_llama, tmp_path):
    """A socket directory owned by another uid stops the daemon (it never serves from a directory
    others control): the pod's log says so and, for `kubectl get wcn`, so does its WeightCacheNode,
    until a daemon starts there and reports."""
    cp = control_plane
    install_crds(cp)
    cache = f"nostart{uuid.uuid4().hex[:5]}"
    (node,) = cp.add_gpu_nodes(1, prefix=cache)
    wcn = {
        "apiVersion": "keepwarm.dev/v1alpha1",
        "kind": "WeightCacheNode",
        "metadata": {"name": f"{cache}.{node}"},
        "spec": {"weightCache": cache, "nodeName": node, "modelDirectory": "/m", "heartbeatSeconds": 1},
    }
    cp.kubectl("create", "namespace", NAMESPACE, check=False)
    docs = [wcn, *agent_rbac(cache, NAMESPACE, None, [])]
    cp.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump_all(docs))
    env = {**cp.env(agent_pod_kubeconfig(cp, cache, node)), "POD_NAMESPACE": NAMESPACE}
    socket_dir = tmp_path / "sock"
    socket_dir.mkdir()
    os.chown(socket_dir, NOBODY, NOBODY)
    cmd = serve_command(socket_dir, [], "--report-to-kubernetes", "--weightcache", cache, "--node-name", node)
    path = f"{GROUP_PATH}/weightcachenodes/{cache}.{node}"
    try:
        failed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert failed.returncode == 2 and str(socket_dir) in failed.stderr, failed.stderr
        status = get(cp, path).get("status") or {}
        assert status, failed.stderr
        (started,) = [c for c in status["conditions"] if c["type"] == DAEMON_STARTED]
        assert status["phase"] == "Degraded" and started["status"] == "False", status
        assert started["reason"] == "StartFailed" and str(socket_dir) in started["message"], started

        os.chown(socket_dir, 0, 0)  # the fault goes away: the next start reports as usual
        log = tmp_path / "agent.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        try:

            def reporting():
                status = (get(cp, path) or {}).get("status") or {}
                types = [c["type"] for c in status.get("conditions", [])]
                return status.get("phase") == "Ready" and DAEMON_STARTED not in types

            wait(cp, reporting, f"the started daemon's report replaces the failure (agent log {log})", 60)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    finally:
        _remove_agent(cp, cache, node)


def test_a_weightcache_models_adapters_are_cached_attached_released_and_failed_alone(
    control_plane, tiny_llama, tmp_path
):
    """spec.models[].adapters end to end: the API server takes the field (and refuses a bad one), the
    node spec the operator derives from it (node_spec) reaches a real agent, which loads each adapter
    into its daemon; the node's status lists each adapter, a runtime client attaches a Resident one
    from the daemon socket, a corrupt one fails alone, and one removed from the spec is released."""
    from keepwarm_api.weightcache import WeightCacheSpec
    from keepwarm_api.weightcachenode import node_spec
    from keepwarm_runtime.cache.client import attach_adapter
    from tests.lora_adapters import make_adapter

    cp = control_plane
    install_crds(cp)
    cache = f"lora{uuid.uuid4().hex[:5]}"
    (node,) = cp.add_gpu_nodes(1, prefix=cache)
    models = tmp_path / "models"
    shutil.copytree(tiny_llama, models / "base")
    sql = make_adapter(
        tiny_llama, models / "adapters" / "sql", seed=1, r=4, lora_alpha=8, target_modules=["q_proj"]
    )
    make_adapter(tiny_llama, models / "adapters" / "de", seed=2, r=4, lora_alpha=8, target_modules=["o_proj"])
    broken = models / "adapters" / "broken"
    shutil.copytree(sql, broken)
    (broken / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")

    def adapter(name):
        return {"name": name, "source": {"path": f"/m/adapters/{name}"}}

    spec = {
        "tier": "host",
        "modelDirectory": "/m",
        "heartbeatSeconds": 1,
        "models": [
            {
                "name": "base",
                "source": {"path": "/m/base"},
                "adapters": [adapter(n) for n in ("sql", "de", "broken")],
            }
        ],
    }
    wc = {
        "apiVersion": "keepwarm.dev/v1alpha1",
        "kind": "WeightCache",
        "metadata": {"name": cache},
        "spec": spec,
    }
    refused = json.loads(json.dumps(wc))
    refused["spec"]["models"][0]["adapters"][0]["source"]["path"] = "/elsewhere/sql"
    out = cp.kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump(refused), check=False)
    assert (
        out.returncode != 0 and "an adapter's source.path must lie under spec.modelDirectory" in out.stderr
    ), out
    stored = json.loads(cp.kubectl("create", "-o", "json", "-f", "-", input=yaml.safe_dump(wc)).stdout)
    assert [a["name"] for a in stored["spec"]["models"][0]["adapters"]] == ["sql", "de", "broken"]

    def explained():  # the API server publishes a new CRD's schema to kubectl explain asynchronously
        out = cp.kubectl("explain", "wc.spec.models.adapters", check=False).stdout
        return "unique within the model" in out and "source" in out

    wait(cp, explained, "kubectl explain of spec.models.adapters")
    node_obj = node_spec(cache, node, WeightCacheSpec.model_validate(stored["spec"]))
    wcn = {
        "apiVersion": "keepwarm.dev/v1alpha1",
        "kind": "WeightCacheNode",
        "metadata": {"name": f"{cache}.{node}"},
        "spec": node_obj.wire(),
    }  # what the operator writes for the node, from the WeightCache above
    cp.kubectl("create", "namespace", NAMESPACE, check=False)
    docs = [wcn, *agent_rbac(cache, NAMESPACE, None, [])]
    cp.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump_all(docs))
    env = {
        **cp.env(agent_pod_kubeconfig(cp, cache, node)),
        "KEEPWARM_HOST_MODEL_ROOT": str(models),  # the mount of modelDirectory /m
        "POD_NAMESPACE": NAMESPACE,
    }
    socket_dir = tmp_path / "sock"
    cmd = serve_command(
        socket_dir,
        [],
        "--dtype",
        "bfloat16",
        "--report-to-kubernetes",
        "--weightcache",
        cache,
        "--node-name",
        node,
    )
    log = tmp_path / "agent.log"
    path = f"{GROUP_PATH}/weightcachenodes/{cache}.{node}"
    with open(log, "w") as out_file:
        proc = subprocess.Popen(cmd, env=env, stdout=out_file, stderr=subprocess.STDOUT, cwd=ROOT)
    try:

        def reported():
            status = (get(cp, path) or {}).get("status") or {}
            models_ = {m["name"]: m["state"] for m in status.get("models", [])}
            adapters = {a["name"]: a for a in status.get("adapters", [])}
            return models_, adapters, status

        def first_pass():
            models_, adapters, status = reported()
            states = {n: a["state"] for n, a in adapters.items()}
            wanted = {"sql": "Resident", "de": "Resident", "broken": "Failed"}
            return models_ == {"base": "Resident"} and states == wanted and status

        status = wait(cp, first_pass, f"base, sql and de resident, broken failed (agent log {log})", 120)
        adapters = {a["name"]: a for a in status["adapters"]}
        assert all(a["model"] == "base" for a in adapters.values())
        assert adapters["sql"]["bytes"] > 0 and adapters["sql"]["fingerprint"]
        assert "broken" in adapters["broken"]["message"] and adapters["broken"]["retryAt"], adapters
        assert status["phase"] == "Degraded"  # an adapter failed; the model did not
        # A runtime pod's client attaches the adapter from the daemon, zero-copy, no disk fallback.
        hit = attach_adapter(sql, socket_dir, dtype="bfloat16", fallback=False)
        assert hit.source == "cache" and hit.model == "sql" and hit.tensors, hit

        def ls():
            """`keepwarm cache ls`: name -> kind (or Failed)."""
            argv = [sys.executable, "-m", "keepwarm_runtime.cli", "cache", "ls"]
            listing = subprocess.run(
                [*argv, "--socket", str(socket_dir / "host.sock")],
                capture_output=True, text=True, timeout=60, check=True, cwd=ROOT,
            ).stdout  # fmt: skip
            return {line.split("\t")[0]: line.split("\t")[1] for line in listing.splitlines()}

        assert {n: k for n, k in ls().items() if k != "Failed"} == {
            "base": "model",
            "sql": "adapter",
            "de": "adapter",
        }
        # sql leaves the spec (the operator writes the node spec anew): released, gone from the status.
        patch = {"spec": {"models": [{**spec["models"][0], "adapters": [adapter("de")]}]}}
        cp.kubectl("patch", "wcn", f"{cache}.{node}", "--type=merge", "-p", json.dumps(patch))

        def released():
            models_, adapters, status = reported()
            return models_ == {"base": "Resident"} and set(adapters) == {"de"} and status["phase"] == "Ready"

        wait(cp, released, f"sql and broken released, de resident (agent log {log})", 60)
        assert {n: k for n, k in ls().items() if k != "Failed"} == {"base": "model", "de": "adapter"}
        assert proc.poll() is None, log.read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        _remove_agent(cp, cache, node)
        cp.kubectl("delete", "wc", cache, check=False)
