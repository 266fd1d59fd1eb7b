"""The operator on a test control plane, for the end-to-end tests and bench/operator_scale.py: install
the CRDs and the chart's RBAC, run `keepwarm-operator run` as the chart's ServiceAccount in a
subprocess, read objects as admin, read the operator's metrics with prometheus_client's parser."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from keepwarm_runtime.server.launcher import free_port

ROOT = Path(__file__).resolve().parents[2]  # the repository (this package is installed editable)
CHART = ROOT / "charts" / "keepwarm"
CRDS = CHART / "crds"  # the generated CRDs (keepwarm_api.crdgen)
RELEASE, NAMESPACE = "kw", "keepwarm-system"
OPERATOR_SA = f"{RELEASE}-keepwarm"
GROUP_PATH = "/apis/keepwarm.dev/v1alpha1"
AUTHZ_DECISION = "authorization.k8s.io/decision"  # audit annotation: "allow" or "forbid"


def get(cp: Any, path: str) -> dict | None:
    resp = cp.http.get(path)
    if resp.status_code == 404:
        return None
    resp.raise_for_status()
    return resp.json()


def agent_pod_kubeconfig(cp: Any, cache: str, node: str) -> Path:
    """A kubeconfig holding the agent's token bound to an agent pod on `node`, as a kubelet would
    mount it: the node claim the agent policies check comes from that binding."""
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
    return cp.service_account_kubeconfig(NAMESPACE, f"keepwarm-agent-{cache}", create=False, bound_pod=bound)


def items(cp: Any, path: str) -> list[dict]:
    return (get(cp, path) or {}).get("items", [])


def condition(obj: dict | None, type_: str) -> dict:
    for c in ((obj or {}).get("status") or {}).get("conditions", []):
        if c["type"] == type_:
            return c
    return {}


def install_crds(cp: Any) -> None:
    cp.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRDS))
    for crd in sorted(CRDS.glob("*.yaml")):
        name = yaml.safe_load(crd.read_text())["metadata"]["name"]
        cp.kubectl("wait", "--for=condition=Established", f"crd/{name}", "--timeout=60s")


def install_lws_crds(cp: Any) -> list[str]:
    """The LeaderWorkerSet API alone (its CRDs, from the node build; no controller, no webhooks): the
    operator can apply and watch LeaderWorkerSets, none runs a pod. Returns the CRD names."""
    from keepwarm_testing.node.addons import lws_crds
    from keepwarm_testing.node.build import build_node_components

    names = []
    for crd in lws_crds(build_node_components()):
        cp.kubectl("apply", "--server-side", "-f", str(crd))
        names.append(yaml.safe_load(crd.read_text())["metadata"]["name"])
    for name in names:
        cp.kubectl("wait", "--for=condition=Established", f"crd/{name}", "--timeout=60s")
    return names


def render_chart(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The chart's manifests as Helm renders them for release RELEASE in NAMESPACE."""
    rendered = helm.Chart.load(CHART).render(values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return [
        d for path, text in rendered.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d
    ]


def install_chart_rbac(cp: Any) -> None:
    """The chart's ServiceAccount, ClusterRole(+Binding), peering object and agent admission policy."""
    wanted = {
        "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "ClusterKopfPeering",
        "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
    }  # fmt: skip
    docs = [d for d in render_chart() if d.get("kind") in wanted]
    cp.kubectl("create", "namespace", NAMESPACE, check=False)
    cp.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump_all(docs))


def samples(text: str, name: str | None = None) -> list[Sample]:
    """Samples of a Prometheus exposition text, parsed by prometheus_client (optionally one name)."""
    return [
        s
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if name is None or s.name == name
    ]


class OperatorProcess:
    """`keepwarm-operator run` in a subprocess, authenticated as the chart's ServiceAccount."""

    def __init__(self, cp: Any, log_dir: Path, resync_s: float = 1.0, priority: int = 100):
        self.cp, self.log_dir, self.resync_s, self.priority = cp, log_dir, resync_s, priority
        self.metrics_port, self.health_port = free_port(), free_port()
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def log(self) -> Path:
        return self.log_dir / f"operator-{self.priority}.log"

    def start(self) -> OperatorProcess:
        self.starts += 1
        kubeconfig = self.cp.service_account_kubeconfig(NAMESPACE, OPERATOR_SA, create=False)
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
        env["KUBECONFIG"] = str(kubeconfig)
        cmd = [
            sys.executable, "-m", "keepwarm_operator.cli", "run",
            # A killed replica stays in the peering object for its lifetime; the restarted one must not
            # share its priority (kopf pauses every operator of equal priority).
            "--agent-namespace", NAMESPACE, "--peering", "keepwarm",
            "--priority", str(self.priority + self.starts),
            "--metrics-port", str(self.metrics_port), "--liveness-port", str(self.health_port),
            "--resync-seconds", str(self.resync_s),
        ]  # fmt: skip
        out = open(self.log, "a")  # noqa: SIM115 (lives as long as the process)
        out.write(f"\n=== start {self.starts} ===\n")
        out.flush()
        self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        self.cp.wait_for(self.healthy, timeout_s=60, what=f"operator /healthz (log {self.log})")
        return self

    def healthy(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            raise RuntimeError(f"operator exited: {self.tail()}")
        import httpx

        try:
            return httpx.get(f"http://127.0.0.1:{self.health_port}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def metrics(self) -> str:
        import httpx

        return httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text

    def samples(self, name: str | None = None) -> list[Sample]:
        """The operator's /metrics samples (all, or those of one sample name, e.g. ..._total)."""
        return samples(self.metrics(), name)

    def kill(self) -> None:
        """SIGKILL: no graceful shutdown, as a crashed or evicted pod."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()

    def tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def errors(self) -> list[str]:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return [line for line in text.splitlines() if " ERROR " in line or "Traceback" in line]


def wait(
    cp: Any, predicate: Any, what: str, timeout_s: float = 60.0, op: OperatorProcess | None = None
) -> Any:
    try:
        return cp.wait_for(predicate, timeout_s=timeout_s, what=what)
    except TimeoutError as exc:
        detail = f"\n--- operator log ---\n{op.tail()}" if op else ""
        raise TimeoutError(f"{exc}{detail}") from None


# Granted for admission checks, never requested on their own: blockOwnerDeletion in an owner reference
# needs update on the owner's finalizers; RBAC's escalation check lets the operator grant agents get on
# their token Secrets and create/patch on their Leases only because it holds them.
IMPLIED_GRANTS = {("update", "keepwarm.dev", "weightcaches/finalizers"),
                  ("update", "keepwarm.dev", "inferencedeployments/finalizers"),
                  ("get", "", "secrets"),
                  ("create", "coordination.k8s.io", "leases"),
                  ("patch", "coordination.k8s.io", "leases")}  # fmt: skip
# Used only on a path a run may or may not take: an InferenceDeployment is read when a status write
# raced another writer (409) or its Deployment's event came before kopf's index held it; otherwise
# the index's copy serves. Still checked never to be refused.
RACE_ONLY_GRANTS = {("get", "keepwarm.dev", "inferencedeployments")}


def granted(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    """(verb, apiGroup, resource[/subresource]) for every rule of a ClusterRole."""
    return {
        (verb, group, resource)
        for rule in rules
        for verb in rule["verbs"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }


def used(events: list[dict[str, Any]]) -> tuple[set[tuple[str, str, str]], set[tuple[str, str, str]]]:
    """(allowed, forbidden) (verb, apiGroup, resource) triples from audit events; a server-side apply
    that created its object (201) also needed create.

    Forbidden means refused by the authorizer (RBAC). A 403 from admission, such as an exceeded
    ResourceQuota, passed authorization: the grant was used."""
    allowed, forbidden = set(), set()
    for event in events:
        ref = event.get("objectRef")
        if not ref:  # discovery and other non-resource URLs
            continue
        resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        triple = (event["verb"], ref.get("apiGroup", ""), resource)
        code = event.get("responseStatus", {}).get("code", 0)
        if event.get("annotations", {}).get(AUTHZ_DECISION) == "forbid":
            forbidden.add(triple)
            continue
        allowed.add(triple)
        if event["verb"] == "patch" and code == 201:
            allowed.add(("create", triple[1], resource))
    return allowed, forbidden
