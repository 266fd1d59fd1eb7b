"""kube-proxy for the test cluster: one per machine, since every node's pods come in over one bridge.

It turns Service addresses into endpoints with iptables rules on this host (`mode: iptables`), which is
what lets a pod's in-cluster client reach the API server at the `kubernetes` Service's address. Its
choices keep the machine as it was: no conntrack sysctls touched (`maxPerCore: 0`), NodePorts only on the
bridge's range, no masquerading beyond the cluster's range. `stop()` runs `kube-proxy --cleanup`, which
removes every rule it made; `remove_chains()` the kubelets' own; `leftovers()` says if any survived.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from keepwarm_runtime.server.launcher import free_port

from ..controlplane.pki import PKI, write_kubeconfig
from . import process


@dataclass
class KubeProxy:
    workdir: Path
    bin_dir: Path  # the control plane's build: kube-proxy
    server: str
    pki: PKI
    node: str  # the node it reports as (any node of this machine)
    cluster_cidr: str
    proc: subprocess.Popen | None = None

    @property
    def config(self) -> Path:
        return self.workdir / "kube-proxy.json"

    def start(self) -> KubeProxy:
        self.workdir.mkdir(parents=True, exist_ok=True)
        client = self.pki.issue("kube-proxy", "system:kube-proxy")  # bound to system:node-proxier by default
        kubeconfig = write_kubeconfig(
            self.workdir / "kube-proxy.kubeconfig",
            self.server,
            self.pki.ca.cert,
            "system:kube-proxy",
            client=client,
        )
        self.config.write_text(
            json.dumps(
                {
                    "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
                    "kind": "KubeProxyConfiguration",
                    "clientConnection": {"kubeconfig": str(kubeconfig)},
                    "mode": "iptables",
                    "hostnameOverride": self.node,
                    "clusterCIDR": self.cluster_cidr,
                    "bindAddress": "127.0.0.1",
                    "healthzBindAddress": f"127.0.0.1:{free_port()}",
                    "metricsBindAddress": f"127.0.0.1:{free_port()}",
                    "nodePortAddresses": [self.cluster_cidr],
                    "conntrack": {"maxPerCore": 0, "min": 0},
                    "iptables": {"localhostNodePorts": False, "masqueradeAll": False, "syncPeriod": "5s"},
                }
            )
        )
        log = open(self.workdir / "kube-proxy.log", "ab")  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen(
            [str(self.bin_dir / "kube-proxy"), f"--config={self.config}", "--v=1"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        return self

    def log_tail(self, lines: int = 30) -> str:
        return process.log_tail(self.workdir / "kube-proxy.log", lines)

    def stop(self) -> None:
        process.stop(self.proc, grace_s=15)
        self.proc = None
        subprocess.run(
            [str(self.bin_dir / "kube-proxy"), f"--config={self.config}", "--cleanup"],
            capture_output=True,
            timeout=60,
        )

    @staticmethod
    def remove_chains() -> None:
        """Delete every KUBE- chain and every rule jumping to one, in each table, IPv4 and IPv6: what
        `kube-proxy --cleanup` leaves (the kubelet's own canary and localnet chains). One cluster with
        real nodes runs on a machine at a time (node/cluster.py), so every such chain is this one's."""
        for tool in ("iptables", "ip6tables"):
            for table in ("filter", "nat", "mangle"):
                rules = subprocess.run([tool, "-t", table, "-S"], capture_output=True, text=True).stdout
                chains = [line.split()[1] for line in rules.splitlines() if line.startswith("-N KUBE-")]
                for line in rules.splitlines():
                    words = line.split()
                    if (
                        words[:1] == ["-A"]
                        and not words[1].startswith("KUBE-")
                        and any(w.startswith("KUBE-") for w in words[2:])
                    ):
                        subprocess.run([tool, "-t", table, "-D", *words[1:]], capture_output=True)
                for flag in ("-F", "-X"):
                    for chain in chains:
                        subprocess.run([tool, "-t", table, flag, chain], capture_output=True)

    @staticmethod
    def leftovers() -> list[str]:
        """KUBE- chains still in this machine's iptables (any table)."""
        found = []
        for tool in ("iptables-save", "ip6tables-save"):
            out = subprocess.run([tool], capture_output=True, text=True).stdout
            found += [f"{tool}: {line}" for line in out.splitlines() if line.startswith(":KUBE-")]
        return found
