"""A real Kubernetes control plane on loopback for tests: etcd, kube-apiserver (RBAC on),
kube-controller-manager, kube-scheduler, plus nodes: status-only fake GPU nodes (kubelet.py), or with
`run_pods=True` (root only) real ones.

`run_pods=True` runs real nodes (keepwarm_testing.node): the kubelet on containerd and runc, pods on a
bridge network this machine owns, images built from the repository's Dockerfile and pulled from a
registry on loopback under the names the chart and the CRDs use (the nodes mirror those registries to
it). The API server is reachable from pods at the bridge's address (a TCP forwarder; the serving
certificate names it), which it advertises as the `kubernetes` Service's endpoint, and kube-proxy turns
that Service's address into it, so in-cluster clients connect as in any cluster. CoreDNS on the bridge
is the cluster DNS (`cluster.local`), and `install_lws()` adds the LeaderWorkerSet API (node/addons.py).

    from keepwarm_testing.controlplane.build import build_control_plane
    with ControlPlane(build_control_plane()) as cp:
        cp.add_gpu_nodes(3)
        cp.kubectl("get", "nodes")

Everything lives under one temporary directory that `stop()` removes; when the run failed the logs
are kept and their path is printed. Child processes die with the parent (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import datetime as dt
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from keepwarm_api.kube import OPERATOR_FIELD_MANAGER, Kube, connect
from keepwarm_runtime.server.launcher import free_port

from ..node.addons import LwsManager
from ..node.cluster import NodeSet
from .apiproxy import TcpForwarder
from .kubelet import FakeKubelet
from .pki import PKI, SERVING_NAMES, client_ssl_context, write_kubeconfig

SERVICE_CIDR = "10.0.0.0/16"  # room for a Service per InferenceDeployment at bench scale (400+)
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
# What the tests check RBAC against: every request a ServiceAccount (operator, agents) makes, with
# verb, resource and response code; nothing from the control plane's own components.
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        {"level": "Metadata", "userGroups": ["system:serviceaccounts"]},
        {"level": "None"},
    ],
}


def _unix_time(rfc3339: str) -> float:
    """An audit timestamp such as 2026-12-03T06:40:01.123456Z as a Unix time."""
    return dt.datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()


class ControlPlaneError(RuntimeError):
    """A component failed to start or answer; the message carries its log tail and the log path."""


def _bound_to(pod: dict[str, Any] | None) -> dict[str, Any]:
    if pod is None:
        return {}
    meta = pod["metadata"]
    return {"boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": meta["name"], "uid": meta["uid"]}}


def _die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class ControlPlane:
    """Start with `start()` or `with ControlPlane(bin_dir) as cp:`; see the module docstring."""

    def __init__(
        self,
        bin_dir: Path | str,
        *,
        workdir: Path | None = None,
        extra_args: dict[str, list[str]] | None = None,
        heartbeat_s: float = 10.0,
        run_pods: bool = False,
    ) -> None:
        self.run_pods = run_pods
        self.nodes: NodeSet | None = (
            None  # the real nodes and what they share (run_pods=True), from start() on
        )
        self._api_proxy: TcpForwarder | None = None
        self.bin_dir = Path(bin_dir)
        for name in (*COMPONENTS, "kubectl"):
            if not (self.bin_dir / name).is_file():
                raise ControlPlaneError(
                    f"{self.bin_dir / name} missing: run testing/keepwarm_testing/controlplane/build.sh"
                )
        self.root = Path(workdir or tempfile.mkdtemp(prefix="keepwarm-cp-"))
        self.data = self.root / "data"
        self.logs = self.root / "logs"
        self.extra_args = extra_args or {}
        self.heartbeat_s = heartbeat_s
        self.procs: dict[str, subprocess.Popen] = {}
        self.ports = {
            name: free_port()
            for name in ("etcd", "etcd-peer", "apiserver", "controller-manager", "scheduler")
        }
        self.server = f"https://127.0.0.1:{self.ports['apiserver']}"
        self.kubelet: FakeKubelet | None = None
        self._http: httpx.Client | None = None
        self._node_seq = 0

    # -- lifecycle -------------------------------------------------------------------------------
    def __enter__(self) -> ControlPlane:
        try:
            return self.start()
        except BaseException:
            self.stop(failed=True)
            raise

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self.stop(failed=exc_type is not None)

    def start(self, timeout_s: float = 180.0) -> ControlPlane:
        self.data.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        if self.run_pods:  # images built (or found) and published first: minutes on a fresh machine
            self.nodes = NodeSet(self.root / "nodes", SERVICE_CIDR).prepare()
        deadline = time.monotonic() + timeout_s
        self._make_credentials()
        self._spawn("etcd", self._etcd_args())
        self._wait(
            "etcd",
            lambda: httpx.get(f"http://127.0.0.1:{self.ports['etcd']}/health", timeout=2).status_code == 200,
            deadline,
        )
        self._spawn("kube-apiserver", self._apiserver_args())
        self._http = self.http_client()
        self._wait("kube-apiserver", lambda: self._http.get("/readyz").status_code == 200, deadline)
        if self.nodes is not None:
            port = self.ports["apiserver"]
            self._api_proxy = TcpForwarder((self.nodes.bridge.gateway, port), ("127.0.0.1", port))
        self._spawn("kube-controller-manager", self._controller_manager_args())
        self._spawn("kube-scheduler", self._scheduler_args())
        for name, port in (
            ("kube-controller-manager", "controller-manager"),
            ("kube-scheduler", "scheduler"),
        ):
            url = f"https://127.0.0.1:{self.ports[port]}/healthz"
            self._wait(
                name, lambda url=url: httpx.get(url, verify=False, timeout=2).status_code == 200, deadline
            )
        # Pods can only be created once the service-account controller made the namespace's default SA.
        self._wait(
            "kube-controller-manager",
            lambda: self._http.get("/api/v1/namespaces/default/serviceaccounts/default").status_code == 200,
            deadline,
        )
        self.kubelet = FakeKubelet(self.server, self.admin_tls(), heartbeat_s=self.heartbeat_s)
        self.kubelet.start()
        if self.nodes is not None:
            self.nodes.start(self.server, self.pki, self.bin_dir)
        return self

    def stop(self, *, failed: bool = False) -> None:
        """Stop everything and delete the data; on failure keep (and print) the logs."""
        if self.kubelet is not None:
            self.kubelet.stop()
            self.kubelet = None
        if self.nodes is not None:
            self.nodes.stop(keep_logs=self.logs if failed else None)
        if self._api_proxy is not None:
            self._api_proxy.close()
            self._api_proxy = None
        if self._http is not None:
            self._http.close()
            self._http = None
        for name in reversed(list(self.procs)):
            proc = self.procs.pop(name)
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if failed:
            for child in self.root.iterdir() if self.root.exists() else ():
                if child != self.logs:
                    shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink()
            print(f"\ncontrol plane logs kept in {self.logs}", file=sys.stderr)
        else:
            shutil.rmtree(self.root, ignore_errors=True)

    # -- helpers for tests -----------------------------------------------------------------------
    @property
    def kubeconfig(self) -> Path:
        """Admin kubeconfig (system:masters)."""
        return self.data / "admin.kubeconfig"

    @property
    def http(self) -> httpx.Client:
        """An httpx client authenticated as admin, base URL set to the API server."""
        if self._http is None:
            raise ControlPlaneError("control plane not started: call start() or use it as a context manager")
        return self._http

    def admin_tls(self) -> ssl.SSLContext:
        """TLS context that trusts this cluster's CA and authenticates as admin."""
        return client_ssl_context(self.pki.ca.cert, self.admin)

    def http_client(self, timeout: httpx.Timeout | float = 30.0) -> httpx.Client:
        """A new admin httpx client (e.g. one per thread, or with read=None for long watches)."""
        return httpx.Client(base_url=self.server, verify=self.admin_tls(), timeout=timeout)

    def env(self, kubeconfig: Path | None = None) -> dict[str, str]:
        """os.environ plus KUBECONFIG, for a subprocess such as the operator."""
        return {**os.environ, "KUBECONFIG": str(kubeconfig or self.kubeconfig)}

    def kubectl(
        self,
        *args: str,
        kubeconfig: Path | None = None,
        check: bool = True,
        input: str | None = None,
        timeout: float = 60.0,
    ) -> subprocess.CompletedProcess[str]:
        """Run the real kubectl against this cluster (admin unless `kubeconfig` is given)."""
        cmd = [str(self.bin_dir / "kubectl"), "--kubeconfig", str(kubeconfig or self.kubeconfig), *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, input=input, timeout=timeout)
        if check and proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, cmd, proc.stdout, proc.stderr)
        return proc

    def kube(self, kubeconfig: Path | None = None, field_manager: str = OPERATOR_FIELD_MANAGER) -> Kube:
        """keepwarm's client (the operator's and the agent's) for this cluster: admin unless
        `kubeconfig` is given."""
        return connect(str(kubeconfig or self.kubeconfig), field_manager)

    def add_gpu_nodes(
        self,
        n: int,
        *,
        labels: dict[str, str] | None = None,
        gpus: int = 8,
        prefix: str = "gpu-node",
        taints: list[dict] | None = None,
    ) -> list[str]:
        """Register n Ready GPU nodes (capacity `nvidia.com/gpu: gpus`); returns their names once the
        node lifecycle controller has lifted the `not-ready` taint every new Node is born with. Fake ones
        (status only), or real ones with run_pods=True (their GPUs are only advertised: no device)."""
        kubelet = self._kubelet()
        names = []
        for _ in range(n):
            self._node_seq += 1
            name = f"{prefix}-{self._node_seq}"
            if self.nodes is not None:
                self.nodes.add(self, name, labels=labels, gpus=gpus, taints=taints)
            else:
                kubelet.add_node(name, labels=labels, gpus=gpus, taints=taints)
            names.append(name)

        def schedulable() -> bool:
            nodes = self.http.get("/api/v1/nodes").json()["items"]
            return not any(
                t["key"] == "node.kubernetes.io/not-ready"
                for node in nodes
                if node["metadata"]["name"] in names
                for t in node["spec"].get("taints", [])
            )

        self.wait_for(schedulable, timeout_s=60 + n, what=f"{n} new nodes losing their not-ready taint")
        return names

    def install_lws(self) -> LwsManager:
        """The LeaderWorkerSet API (sigs.k8s.io/lws: CRDs, webhooks, controller) in this cluster, once
        (run_pods=True only; node/addons.py); a second call returns the running one."""
        if self.nodes is None:
            raise ControlPlaneError("the LeaderWorkerSet controller runs with real nodes: run_pods=True")
        return self.nodes.install_lws(self)

    def remove_node(self, name: str, *, delete_pods: bool = True) -> None:
        """Delete a fake node (see FakeKubelet.remove_node for what happens to its pods)."""
        kubelet = self._kubelet()
        kubelet.remove_node(name, delete_pods=delete_pods)

    def service_account_kubeconfig(
        self, namespace: str, name: str, *, create: bool = True, expiration_s: int = 86400,
        bound_pod: dict[str, Any] | None = None,
    ) -> Path:  # fmt: skip
        """A kubeconfig holding a fresh token of ServiceAccount namespace/name: whatever runs with it is
        authorized by that account's RBAC only. create=True makes the namespace and account if missing.
        bound_pod (a Pod running as that account) binds the token to it, as the kubelet does: the API
        server then names the pod's node in the token's user info."""
        if create:
            for path, body in (
                ("/api/v1/namespaces", {"metadata": {"name": namespace}}),
                (f"/api/v1/namespaces/{namespace}/serviceaccounts", {"metadata": {"name": name}}),
            ):
                resp = self.http.post(
                    path,
                    json={
                        "apiVersion": "v1",
                        **body,
                        "kind": "Namespace" if path.endswith("namespaces") else "ServiceAccount",
                    },
                )
                if resp.status_code not in (201, 409):
                    raise ControlPlaneError(f"POST {path}: HTTP {resp.status_code}: {resp.text}")
        resp = self.http.post(
            f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
            json={
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {"expirationSeconds": expiration_s, **_bound_to(bound_pod)},
            },
        )
        if resp.status_code != 201:
            raise ControlPlaneError(f"token for {namespace}/{name}: HTTP {resp.status_code}: {resp.text}")
        suffix = f"-{bound_pod['metadata']['name']}" if bound_pod else ""
        path = self.data / f"sa-{namespace}-{name}{suffix}.kubeconfig"
        return write_kubeconfig(
            path,
            self.server,
            self.pki.ca.cert,
            f"system:serviceaccount:{namespace}:{name}",
            token=resp.json()["status"]["token"],
            namespace=namespace,
        )

    def wait_for(
        self,
        predicate: Callable[[], Any],
        *,
        timeout_s: float = 60.0,
        what: str = "condition",
        interval_s: float = 0.25,
    ) -> Any:
        """Poll until predicate() is truthy (returns its value); raise TimeoutError naming `what`."""
        deadline = time.monotonic() + timeout_s
        last_exc: Exception | None = None
        while time.monotonic() < deadline:
            try:
                value = predicate()
                if value:
                    return value
            except Exception as exc:
                last_exc = exc
            time.sleep(interval_s)
        raise TimeoutError(
            f"timed out after {timeout_s:.0f}s waiting for {what}"
            + (f" (last error: {last_exc!r})" if last_exc else "")
            + (f"\n{self.explain_pods()}" if self.nodes is not None else "")
        )

    def explain_pods(self, log_lines: int = 15) -> str:
        """Every pod that is not Ready or whose containers have restarted (a crash-looping container
        without a readiness probe is Ready for the moments it runs), named with its phase, its
        containers' states (an image that failed to pull, an entrypoint that does not exist, a crash
        loop), its events and its containers' last log lines: what a test says when pods never came up."""
        lines = []
        for pod in self.http.get("/api/v1/pods").json().get("items", []):
            meta, status = pod["metadata"], pod.get("status", {})
            ready = any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", []))
            restarted = any(c.get("restartCount", 0) for c in status.get("containerStatuses", []))
            if (ready and not restarted) or status.get("phase") == "Succeeded":
                continue
            ns, name = meta["namespace"], meta["name"]
            lines.append(
                f"pod {ns}/{name} on {pod['spec'].get('nodeName') or '(unscheduled)'}: {status.get('phase')}"
            )
            for c in status.get("containerStatuses", []) + status.get("initContainerStatuses", []):
                for kind, state in c.get("state", {}).items():
                    why = " ".join(
                        str(state.get(k, "")) for k in ("reason", "exitCode", "message") if k in state
                    )
                    lines.append(
                        f"  container {c['name']} {kind} {why} (restarts {c.get('restartCount', 0)})"
                    )
            events = self.http.get(
                f"/api/v1/namespaces/{ns}/events", params={"fieldSelector": f"involvedObject.name={name}"}
            ).json()
            for event in events.get("items", [])[-8:]:
                lines.append(
                    f"  event {event.get('type')} {event.get('reason')}: {event.get('message', '')[:300]}"
                )
            for c in pod["spec"]["containers"]:
                for previous in ("false", "true"):
                    log = self.kubectl(
                        "logs", "-n", ns, name, "-c", c["name"], f"--previous={previous}",
                        f"--tail={log_lines}", check=False,
                    )  # fmt: skip
                    if log.returncode == 0 and log.stdout.strip():
                        label = "previous log" if previous == "true" else "log"
                        lines.append(f"  {c['name']} {label}:\n    " + "\n    ".join(log.stdout.splitlines()))
        return "\n".join(lines) or "(every pod is Ready)"

    def _kubelet(self) -> FakeKubelet:
        if self.kubelet is None:
            raise ControlPlaneError("control plane not started: call start() or use it as a context manager")
        return self.kubelet

    def log_tail(self, component: str, lines: int = 40) -> str:
        return _tail(self.logs / f"{component}.log", lines)

    # -- internals -------------------------------------------------------------------------------
    def _make_credentials(self) -> None:
        self.pki = PKI(self.data / "pki")
        names = SERVING_NAMES + ([f"IP:{self.nodes.bridge.gateway}"] if self.nodes else [])
        self.serving = self.pki.issue("apiserver", "kube-apiserver", alt_names=names)
        self.admin = self.pki.issue("admin", "keepwarm-admin", organization="system:masters")
        self.sa_keys = self.pki.service_account_keys()
        ca = self.pki.ca.cert
        write_kubeconfig(self.kubeconfig, self.server, ca, "admin", client=self.admin)
        # The API server's identity towards the kubelets (logs, exec, port-forward).
        self.kubelet_client = self.pki.issue("apiserver-kubelet-client", "kube-apiserver", "system:masters")
        for user in ("kube-controller-manager", "kube-scheduler"):
            pair = self.pki.issue(user, f"system:{user}")
            write_kubeconfig(self.data / f"{user}.kubeconfig", self.server, ca, user, client=pair)

    def _etcd_args(self) -> list[str]:
        client = f"http://127.0.0.1:{self.ports['etcd']}"
        peer = f"http://127.0.0.1:{self.ports['etcd-peer']}"
        return [
            "--name=cp",
            f"--data-dir={self.data / 'etcd'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=cp={peer}",
            "--unsafe-no-fsync",
            "--log-level=warn",
        ]

    @property
    def audit_log(self) -> Path:
        """Metadata-level audit events of every ServiceAccount's request (JSON lines)."""
        return self.logs / "audit.log"

    def audit_events(self, user: str, since: float = 0.0) -> list[dict[str, Any]]:
        """The audit events (ResponseComplete stage) of one user, e.g. system:serviceaccount:NS:NAME,
        received at or after `since` (a Unix time): tests sharing the control plane share its log."""
        events: list[dict[str, Any]] = []
        if not self.audit_log.exists():  # no ServiceAccount has made a request yet
            return events
        with open(self.audit_log, errors="replace") as lines:
            for line in lines:
                try:
                    event = json.loads(line)
                except ValueError:  # the line being written right now
                    continue
                if (
                    event.get("user", {}).get("username") == user
                    and event.get("stage") == "ResponseComplete"
                    and _unix_time(event["requestReceivedTimestamp"]) >= since
                ):
                    events.append(event)
        return events

    def _apiserver_args(self) -> list[str]:
        d = self.data
        policy = d / "audit-policy.yaml"
        policy.write_text(json.dumps(AUDIT_POLICY))
        return [
            f"--audit-policy-file={policy}",
            f"--audit-log-path={self.audit_log}",
            "--audit-log-format=json",
            "--audit-log-mode=batch",
            "--audit-log-batch-max-wait=1s",
            f"--etcd-servers=http://127.0.0.1:{self.ports['etcd']}",
            "--bind-address=127.0.0.1",
            *self._advertised(),
            f"--secure-port={self.ports['apiserver']}",
            f"--cert-dir={d / 'apiserver'}",
            f"--tls-cert-file={self.serving.cert}",
            f"--tls-private-key-file={self.serving.key}",
            f"--client-ca-file={self.pki.ca.cert}",
            f"--service-account-issuer={SA_ISSUER}",
            f"--service-account-key-file={self.sa_keys.cert}",
            f"--service-account-signing-key-file={self.sa_keys.key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--authorization-mode=Node,RBAC",
            "--allow-privileged=true",
            f"--kubelet-client-certificate={self.kubelet_client.cert}",
            f"--kubelet-client-key={self.kubelet_client.key}",
            "--kubelet-preferred-address-types=InternalIP",
            "--profiling=false",
        ]

    def _advertised(self) -> list[str]:
        """Where in-cluster clients find the API server: on real nodes the bridge's address (forwarded
        to loopback), the `kubernetes` Service's endpoint; with fake nodes nobody in the cluster asks, and
        a loopback address may not be an endpoint."""
        if self.nodes is None:
            return ["--advertise-address=127.0.0.1", "--endpoint-reconciler-type=none"]
        return [f"--advertise-address={self.nodes.bridge.gateway}", "--endpoint-reconciler-type=lease"]

    def _component_common(self, name: str, port: str) -> list[str]:
        kubeconfig = self.data / f"{name}.kubeconfig"
        return [
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={self.ports[port]}",
            f"--cert-dir={self.data / name}",
            "--leader-elect=false",
        ]

    def _controller_manager_args(self) -> list[str]:
        return [
            *self._component_common("kube-controller-manager", "controller-manager"),
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={self.sa_keys.key}",
            f"--root-ca-file={self.pki.ca.cert}",
            f"--cluster-signing-cert-file={self.pki.ca.cert}",
            f"--cluster-signing-key-file={self.pki.ca.key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--cluster-name=keepwarm-test",
            "--kube-api-qps=200",
            "--kube-api-burst=400",
        ]

    def _scheduler_args(self) -> list[str]:
        return self._component_common("kube-scheduler", "scheduler")

    def _spawn(self, name: str, args: list[str]) -> None:
        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child from here on
        self.procs[name] = subprocess.Popen(
            [str(self.bin_dir / name), *args, *self.extra_args.get(name, [])],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.data,
            preexec_fn=_die_with_parent,
        )
        log.close()

    def _wait(self, name: str, ready: Callable[[], bool], deadline: float) -> None:
        while True:
            proc = self.procs[name]
            if proc.poll() is not None:
                raise ControlPlaneError(
                    f"{name} exited with {proc.returncode}; log {self.logs / (name + '.log')}:\n"
                    f"{self.log_tail(name)}"
                )
            try:
                if ready():
                    return
            except (httpx.HTTPError, OSError):
                pass
            if time.monotonic() > deadline:
                raise ControlPlaneError(
                    f"{name} not ready in time; log {self.logs / (name + '.log')}:\n{self.log_tail(name)}"
                )
            time.sleep(0.25)
