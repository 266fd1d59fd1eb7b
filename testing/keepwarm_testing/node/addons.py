"""The test cluster's add-ons, host processes like the control plane's components, built by node/build.sh:

- CoreDNS, the cluster DNS: its `kubernetes` plugin answers `cluster.local` (Services, headless Services'
  pods by hostname) from the API server, everything else goes to this machine's resolv.conf. It listens
  on the bridge's address (10.Y.0.1:53, UDP and TCP), which pods reach on-link, and every kubelet names
  that address as `clusterDNS` (node/kubelet.py), so a ClusterFirst pod resolves as in any cluster.
  `NodeSet.start()` runs it for every cluster with real nodes.
- The LeaderWorkerSet controller (sigs.k8s.io/lws, `lws-manager`), on request (`NodeSet.install_lws`,
  `ControlPlane.install_lws`): its CRDs, its manager (leader election and its own certificate management
  off) serving its webhooks on a loopback port with a certificate of the cluster's CA for 127.0.0.1,
  and its webhook configurations from the module's manifests, patched as its kustomization patches them
  (the pod webhooks only see pods labelled `leaderworkerset.sigs.k8s.io/name`: every other pod never
  reaches them) and pointed at that port. Their failurePolicy stays `Fail`: an LWS pod the webhook
  did not see would run without its LWS_* variables.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import yaml

from keepwarm_runtime.server.launcher import free_port

from ..controlplane.pki import PKI, write_kubeconfig
from . import process

if TYPE_CHECKING:
    from ..controlplane.cluster import ControlPlane

CLUSTER_DOMAIN = "cluster.local"
DNS_PORT = 53
LWS_GROUP = "leaderworkerset.x-k8s.io"
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"  # on every pod of a LeaderWorkerSet


class AddonError(RuntimeError):
    """An add-on exited or never became ready; the message carries its log's tail and path."""


@dataclass
class _HostProcess:
    """One add-on process: its log in its workdir, started once, stopped with SIGTERM."""

    name: str
    workdir: Path
    proc: subprocess.Popen | None = field(default=None, init=False)

    @property
    def log(self) -> Path:
        return self.workdir / f"{self.name}.log"

    def _spawn(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        log = open(self.log, "ab")  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
            env={**os.environ, **(env or {})},
        )  # fmt: skip
        log.close()

    def _wait(self, ready: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            self.check()
            try:
                if ready():
                    return
            except (httpx.HTTPError, OSError):
                pass
            if time.monotonic() > deadline:
                raise AddonError(
                    f"{self.name} not ready in {timeout_s:.0f} s; log {self.log}:\n{self.log_tail()}"
                )
            time.sleep(0.25)

    def check(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise AddonError(
                f"{self.name} exited with {self.proc.returncode}; log {self.log}:\n{self.log_tail()}"
            )

    def log_tail(self, lines: int = 40) -> str:
        return process.log_tail(self.log, lines)

    def stop(self) -> None:
        process.stop(self.proc, grace_s=15)
        self.proc = None


class CoreDNS(_HostProcess):
    def __init__(self, workdir: Path, node_bin: Path, server: str, pki: PKI, address: str) -> None:
        super().__init__("coredns", workdir)
        self.node_bin, self.server, self.pki, self.address = node_bin, server, pki, address

    def corefile(self, kubeconfig: Path, ready_port: int) -> str:
        return f"""\
.:{DNS_PORT} {{
    bind {self.address}
    errors
    ready 127.0.0.1:{ready_port}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig}
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
    forward . /etc/resolv.conf
}}
"""

    def start(self, timeout_s: float = 60.0) -> CoreDNS:
        """Run CoreDNS on `address`:53; returns once its `kubernetes` plugin has synced with the API."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        client = self.pki.issue("coredns", "system:coredns", organization="system:masters")
        kubeconfig = write_kubeconfig(
            self.workdir / "coredns.kubeconfig",
            self.server,
            self.pki.ca.cert,
            "system:coredns",
            client=client,
        )
        ready_port = free_port()
        corefile = self.workdir / "Corefile"
        corefile.write_text(self.corefile(kubeconfig, ready_port))
        self._spawn([str(self.node_bin / "coredns"), "-conf", str(corefile)])
        ready = f"http://127.0.0.1:{ready_port}/ready"
        self._wait(lambda: httpx.get(ready, timeout=2).status_code == 200, timeout_s)
        return self


def lws_crds(node_bin: Path) -> list[Path]:
    """The LeaderWorkerSet CRDs the node build copied beside its bin directory (`lws/`)."""
    return sorted((node_bin.parent / "lws").glob("*.x-k8s.io_*.yaml"))


class LwsManager(_HostProcess):
    """The LeaderWorkerSet controller and its webhooks; `install()` is idempotent."""

    def __init__(self, workdir: Path, node_bin: Path, server: str, pki: PKI) -> None:
        super().__init__("lws-manager", workdir)
        self.node_bin, self.server, self.pki = node_bin, server, pki
        self.manifests = node_bin.parent / "lws"  # build.sh copies the module's CRDs and webhooks here
        self.port = 0

    def install(self, cp: ControlPlane, timeout_s: float = 120.0) -> LwsManager:
        if self.proc is not None:
            self.check()
            return self
        deadline = time.monotonic() + timeout_s
        self.workdir.mkdir(parents=True, exist_ok=True)
        crds = lws_crds(self.node_bin)
        for crd in crds:
            cp.kubectl("apply", "--server-side", "-f", str(crd))
        for crd in crds:
            name = yaml.safe_load(crd.read_text())["metadata"]["name"]
            cp.kubectl("wait", "--for=condition=Established", f"crd/{name}", "--timeout=60s")
        self.port = free_port()
        self._spawn(
            [str(self.node_bin / "lws-manager"), f"--config={self._configuration()}", "--zap-log-level=info"],
            env={"KUBECONFIG": str(self._kubeconfig())},
        )
        self._wait(lambda: _accepts(("127.0.0.1", self.port)), deadline - time.monotonic())
        webhooks = self.workdir / "webhooks.yaml"
        webhooks.write_text(yaml.safe_dump_all(self.webhook_configurations()))
        cp.kubectl("apply", "--server-side", "-f", str(webhooks))
        # Ready once a LeaderWorkerSet passes its defaulting and validating webhooks (a dry run).
        self._wait(lambda: _dry_run(cp) == 201, deadline - time.monotonic())
        return self

    def _kubeconfig(self) -> Path:
        client = self.pki.issue("lws-manager", "lws-controller-manager", organization="system:masters")
        return write_kubeconfig(
            self.workdir / "lws-manager.kubeconfig", self.server, self.pki.ca.cert, "lws-controller-manager",
            client=client,
        )  # fmt: skip

    def _configuration(self) -> Path:
        """The manager's Configuration (config.lws.x-k8s.io/v1alpha1): no leader election, no certificate
        management of its own, its webhook server on loopback with a certificate of the cluster's CA."""
        certs = self.workdir / "certs"
        certs.mkdir(exist_ok=True)
        serving = self.pki.issue("lws-webhook", "lws-webhook", alt_names=["IP:127.0.0.1"])
        shutil.copyfile(serving.cert, certs / "tls.crt")  # controller-runtime's file names
        shutil.copyfile(serving.key, certs / "tls.key")
        path = self.workdir / "configuration.yaml"
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "config.lws.x-k8s.io/v1alpha1",
                    "kind": "Configuration",
                    "leaderElection": {"leaderElect": False},
                    "internalCertManagement": {"enable": False},
                    "webhook": {"host": "127.0.0.1", "port": self.port, "certDir": str(certs)},
                    "metrics": {"bindAddress": "0"},  # off
                    "health": {"healthProbeBindAddress": f"127.0.0.1:{free_port()}"},
                }
            )
        )
        return path

    def webhook_configurations(self) -> list[dict[str, Any]]:
        """The module's webhook manifests with its kustomization's patches applied (the pod webhooks'
        objectSelector), named for LWS, pointing at this manager's port, trusting the cluster's CA."""
        configs = list(yaml.safe_load_all((self.manifests / "manifests.yaml").read_text()))
        patches = {
            "MutatingWebhookConfiguration": "mutating-patch.yaml",
            "ValidatingWebhookConfiguration": "validating-patch.yaml",
        }
        ca = _b64(self.pki.ca.cert)
        for config in configs:
            for op in yaml.safe_load((self.manifests / patches[config["kind"]]).read_text()):
                _, field_name, index = op["path"].split("/")
                if op["op"] != "replace" or field_name != "webhooks":
                    raise AddonError(f"an LWS webhook patch this harness does not apply: {op}")
                config["webhooks"][int(index)] = op["value"]
            config["metadata"]["name"] = f"lws-{config['metadata']['name']}"
            for hook in config["webhooks"]:
                path = hook["clientConfig"]["service"]["path"]
                hook["clientConfig"] = {"url": f"https://127.0.0.1:{self.port}{path}", "caBundle": ca}
        return configs


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def _accepts(address: tuple[str, int]) -> bool:
    with socket.create_connection(address, timeout=1):
        return True


def _dry_run(cp: ControlPlane) -> int:
    probe = {
        "apiVersion": f"{LWS_GROUP}/v1",
        "kind": "LeaderWorkerSet",
        "metadata": {"name": "webhook-probe"},
        "spec": {
            "leaderWorkerTemplate": {
                "size": 2,
                "workerTemplate": {"spec": {"containers": [{"name": "c", "image": "probe"}]}},
            }
        },
    }
    url = f"/apis/{LWS_GROUP}/v1/namespaces/default/leaderworkersets"
    return cp.http.post(url, params={"dryRun": "All"}, json=probe).status_code
