"""The Hugging Face path for real: the agent's downloads against a Hub-compatible server on loopback.

keepwarm_testing.hub runs olah (offline, serving git repositories generated here) behind a token gate,
reached through HF_ENDPOINT exactly as the Hub is. First the download unit (download.py: a commit sha
pins a snapshot, a branch resolves through refs/, a gated repository needs its token); then the node
agent itself (NodeAgent with a real CacheDaemon, the agent ServiceAccount's pod-bound token on the real
API server) following its WeightCacheNode: it reads the token from a Secret, loads a pinned commit and a
branch, and rides out a Hub outage (server stopped, then restarted) by itself through its backoff
(Failed with retryAt, retried without any spec change). A 1 s backoff base keeps the test short.
"""

from __future__ import annotations

import json
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from keepwarm_api.paths import hf_cache_dir
from keepwarm_operator.builders.agent import agent_rbac
from keepwarm_runtime.agent.download import DownloadFailed, download
from keepwarm_testing.hub import LocalHub
from keepwarm_testing.operator import GROUP_PATH, NAMESPACE, agent_pod_kubeconfig, get, install_crds, wait

pytestmark = pytest.mark.slow
TOKEN = "hf_e2e_gate_token"
STALL_S = 60.0  # generous: a loaded box must not look like a hung download


@dataclass(frozen=True)
class Served:
    hub: LocalHub
    shas: dict[str, str]  # first (main's first commit), main (its head), dev, gated, late


@pytest.fixture(scope="module")
def hub(tiny_llama, tmp_path_factory):
    work = tmp_path_factory.mktemp("hub")
    hub = LocalHub(work)
    first = hub.add_repo("org/tiny", tiny_llama)
    moved = hub.commit("org/tiny", {"README.md": b"main moved on\n"})  # the pin must not follow it
    dev = hub.commit("org/tiny", {"NOTES.md": b"a branch\n"}, branch="dev")
    gated = hub.add_repo("org/gated", tiny_llama)
    hub.gate("org/gated", TOKEN)
    late = hub.add_repo("org/late", tiny_llama)
    hub.start()
    yield Served(hub, {"first": first, "main": moved, "dev": dev, "gated": gated, "late": late})
    hub.stop()


@pytest.fixture
def hub_env(hub, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_ENDPOINT", hub.hub.endpoint)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no token of this machine's user
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    return hub


def test_a_commit_sha_pins_the_snapshot_and_a_branch_resolves_through_refs(hub_env, tmp_path):
    shas, cache = hub_env.shas, tmp_path / "hf"
    pinned = download("org/tiny", shas["first"], str(cache), None, STALL_S)
    assert Path(pinned).name == shas["first"] != shas["main"]
    assert not (Path(pinned) / "README.md").exists()  # the later commit on main is not in it
    branch = download("org/tiny", "dev", str(cache), None, STALL_S)
    assert Path(branch).name == shas["dev"]
    assert (cache / "models--org--tiny" / "refs" / "dev").read_text() == shas["dev"]
    assert (Path(branch) / "NOTES.md").read_text() == "a branch\n"
    assert (Path(branch) / "config.json").is_file()


def test_a_gated_repository_needs_its_token(hub_env, tmp_path):
    hub, shas = hub_env.hub, hub_env.shas
    with pytest.raises(DownloadFailed, match="restricted"):
        download("org/gated", "main", str(tmp_path / "anon"), None, STALL_S)
    path = download("org/gated", "main", str(tmp_path / "hf"), TOKEN, STALL_S)
    assert Path(path).name == shas["gated"]
    seen = hub.requests_for("org/gated")
    assert {r.status for r in seen if r.authorization is None} == {401}
    assert all(r.authorization == f"Bearer {TOKEN}" for r in seen if r.status != 401)


def snapshot_dir(agent, name: str) -> str:
    """The Hub snapshot directory the agent resolved for model `name` (keyed by name, repo, revision)."""
    (found,) = [path for (model, _repo, _revision), path in agent.resolved.items() if model == name]
    return found


def test_the_agent_downloads_with_its_token_secret_and_recovers_from_an_outage(
    control_plane, hub_env, tmp_path
):
    from keepwarm_api.kube import AGENT_FIELD_MANAGER
    from keepwarm_runtime.agent.kubernetes import NodeAgent
    from keepwarm_runtime.cache.daemon import CacheDaemon, DaemonConfig

    cp, hub, shas = control_plane, hub_env.hub, hub_env.shas
    install_crds(cp)
    cache = f"hub{uuid.uuid4().hex[:5]}"
    (node,) = cp.add_gpu_nodes(1, prefix=cache)
    secret_name = f"{cache}-hf"

    def hf(repo: str, revision: str, token: bool = False) -> dict:
        source = {"repo": repo, "revision": revision}
        if token:
            source["tokenSecretRef"] = {"name": secret_name}
        return {"huggingFace": source}

    first = [
        {"name": "pinned", "source": hf("org/tiny", shas["first"])},
        {"name": "branch", "source": hf("org/tiny", "dev")},
        {"name": "gated", "source": hf("org/gated", "main", token=True)},
    ]
    wcn_name = f"{cache}.{node}"
    wcn = {
        "apiVersion": "keepwarm.dev/v1alpha1",
        "kind": "WeightCacheNode",
        "metadata": {"name": wcn_name},
        "spec": {"weightCache": cache, "nodeName": node, "heartbeatSeconds": 1, "models": first},
    }  # what the operator writes once the agent pod is bound
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": secret_name, "namespace": NAMESPACE},
        "stringData": {"token": TOKEN},
    }
    cp.kubectl("create", "namespace", NAMESPACE, check=False)
    docs = [wcn, secret, *agent_rbac(cache, NAMESPACE, None, [secret_name])]
    cp.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump_all(docs))
    agent_kc = agent_pod_kubeconfig(cp, cache, node)
    daemon = CacheDaemon(DaemonConfig(socket_dir=tmp_path / "sock", tier="host", dtype="bfloat16"))
    hf_root = tmp_path / "downloads"
    agent = NodeAgent(
        daemon, cache, node, cp.kube(agent_kc, AGENT_FIELD_MANAGER),
        namespace=NAMESPACE, hf_root=str(hf_root), retry_base_s=1.0, stall_timeout_s=STALL_S,
    )  # fmt: skip
    earlier = len(hub.requests_for("org/gated"))  # this module's other tests asked too
    stop = threading.Event()
    runner = threading.Thread(target=agent.run, args=(stop,), daemon=True, name="agent-under-test")
    runner.start()

    def models() -> dict[str, dict]:
        status = (get(cp, f"{GROUP_PATH}/weightcachenodes/{wcn_name}") or {}).get("status") or {}
        return {m["name"]: m for m in status.get("models", [])}

    def states() -> dict[str, str]:
        return {name: m["state"] for name, m in models().items()}

    try:
        resident = dict.fromkeys(("pinned", "branch", "gated"), "Resident")
        wait(cp, lambda: states() == resident, "three Hub models resident", timeout_s=180)
        assert Path(snapshot_dir(agent, "pinned")).name == shas["first"]
        assert Path(snapshot_dir(agent, "branch")).name == shas["dev"]
        assert Path(snapshot_dir(agent, "gated")).name == shas["gated"]
        refs = Path(hf_cache_dir(str(hf_root))) / "models--org--tiny" / "refs"
        assert (refs / "dev").read_text() == shas["dev"]  # the branch, resolved through refs/
        # The token came from the Secret, through the API with the agent's own RBAC, to the Hub.
        assert {r.authorization for r in hub.requests_for("org/gated")[earlier:]} == {f"Bearer {TOKEN}"}

        hub.stop()  # the outage: connections refused from now on
        patch = {"spec": {"models": [*first, {"name": "late", "source": hf("org/late", "main")}]}}
        cp.kubectl("patch", "wcn", wcn_name, "--type=merge", "-p", json.dumps(patch))
        failing = wait(
            cp,
            lambda: (
                (m := models().get("late", {})).get("state") == "Failed" and m.get("attempts", 0) >= 2 and m
            ),
            "late failed, retried by itself and failed again while the Hub is down",
            timeout_s=120,
        )
        assert failing["retryAt"] and "DownloadFailed" in failing["message"], failing
        assert "retrying at" in failing["message"], failing
        assert {states()[n] for n in resident} == {"Resident"}  # what was resident stays so
        generation = get(cp, f"{GROUP_PATH}/weightcachenodes/{wcn_name}")["metadata"]["generation"]

        hub.start()  # the fault goes away; nobody touches the spec
        wait(
            cp,
            lambda: states() == {**resident, "late": "Resident"},
            "late recovered by itself",
            timeout_s=120,
        )
        assert get(cp, f"{GROUP_PATH}/weightcachenodes/{wcn_name}")["metadata"]["generation"] == generation
        assert Path(snapshot_dir(agent, "late")).name == shas["late"]
        recovered = models()["late"]
        assert not recovered.get("retryAt") and not recovered.get("message"), recovered
    finally:
        stop.set()
        runner.join(timeout=60)
        daemon.close()
        if not hub.running:
            hub.start()
        cp.kubectl("delete", "pod", f"keepwarm-agent-{cache}", "-n", NAMESPACE, "--wait=false", check=False)
        cp.remove_node(node)
        cp.kubectl("delete", "wcn", wcn_name, check=False)
        agent_sa = f"keepwarm-agent-{cache}"
        cp.kubectl("delete", "clusterrole,clusterrolebinding", agent_sa, check=False)
        cp.kubectl("delete", "serviceaccount,role,rolebinding", agent_sa, "-n", NAMESPACE, check=False)
        cp.kubectl("delete", "secret", secret_name, "-n", NAMESPACE, check=False)
