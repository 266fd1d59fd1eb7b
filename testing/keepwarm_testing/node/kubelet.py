"""One node's kubelet: its KubeletConfiguration, credentials and process.

The real kubelet of the control plane's Kubernetes, on containerd through the CRI. Choices a test
machine forces, each a documented KubeletConfiguration field, not a patch:
- `failCgroupV1: false`: this machine mounts cgroup v1 controllers only (Kubernetes 1.35 made the
  kubelet refuse that by default; it is still supported when asked for);
- `cgroupRoot` per node: two nodes' kubelets on one machine each own their own cgroup subtree;
- eviction and image GC thresholds at their floor: the tests' disk and memory belong to the machine,
  not the node, and a busy build beside them must not evict a pod;
- `clusterDNS` is CoreDNS on the bridge's address (node/addons.py), `clusterDomain` cluster.local: a
  ClusterFirst pod resolves Services and headless Services' pods as in any cluster; `resolvConf` stays
  this machine's (the search domains it adds, and what Default-policy and host-network pods use).
The node authenticates with a client certificate of `system:node:<name>` (the Node authorizer and the
NodeRestriction admission plugin judge it), and serves its API (logs, exec) with a certificate the
cluster's CA signs, checked against that CA with webhook authorization, as kubeadm sets it up.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from keepwarm_runtime.server.launcher import free_port

from ..controlplane.pki import PKI, write_kubeconfig
from . import process
from .addons import CLUSTER_DOMAIN


class KubeletError(RuntimeError):
    """The kubelet exited or its node never registered; the message carries its log's tail."""


def kubelet_configuration(
    *, address: str, port: int, healthz_port: int, ca: Path, serving_cert: Path, serving_key: Path,
    runtime: str, cgroup_root: str, pod_cidr: str, pod_logs: Path, cluster_dns: str,
    fail_cgroup_v1: bool = False,
) -> dict:  # fmt: skip
    """The KubeletConfiguration of a test node (see the module docstring for the choices)."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "failCgroupV1": fail_cgroup_v1,
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": cgroup_root,
        "cgroupsPerQOS": True,
        "containerRuntimeEndpoint": runtime,
        "imageServiceEndpoint": runtime,
        "address": address,  # the node's own address on the bridge: the API server asks it for logs
        "port": port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz_port,
        "tlsCertFile": str(serving_cert),
        "tlsPrivateKeyFile": str(serving_key),
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(ca)},
        },
        "authorization": {"mode": "Webhook"},
        "podCIDR": pod_cidr,
        "failSwapOn": False,
        "resolvConf": "/etc/resolv.conf",
        "clusterDNS": [cluster_dns],
        "clusterDomain": CLUSTER_DOMAIN,
        "evictionHard": {
            "memory.available": "1Mi",
            "nodefs.available": "1%",
            "nodefs.inodesFree": "1%",
            "imagefs.available": "1%",
        },
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
        "registerNode": True,
        "nodeStatusUpdateFrequency": "10s",
        "syncFrequency": "10s",
        "fileCheckFrequency": "0s",
        "containerLogMaxSize": "10Mi",
        "podLogsDir": str(pod_logs),  # the node's own, not the machine's /var/log/pods
        "maxPods": 110,
        "kubeAPIQPS": 50,
        "kubeAPIBurst": 100,
    }


CGROUP_FS = Path("/sys/fs/cgroup")
# What the kubelet's own refusals mean on a test machine: (a fragment of its error, what to do).
KNOWN_REFUSALS = (
    (
        "run on a host using cgroup v1",  # "configured to not run on a host using cgroup v1"
        "this machine mounts cgroup v1 controllers and failCgroupV1 is true: boot it with cgroup v2 "
        "(systemd.unified_cgroup_hierarchy=1) or keep failCgroupV1: false (node/kubelet.py does)",
    ),
    ("has some missing paths", "the node's cgroupRoot is missing in a cgroup hierarchy: make_cgroup_root()"),
    ("container runtime is down", "containerd does not answer on the node's CRI socket"),
)


def startup_failure(log: str) -> str:
    """The kubelet's reason for exiting, from its log, in one line (with the known remedy, if any)."""
    failed = [
        line for line in log.splitlines() if "command failed" in line or "failed to run Kubelet" in line
    ]
    reason = (failed or log.splitlines()[-1:] or ["(no log)"])[-1].strip()
    for fragment, remedy in KNOWN_REFUSALS:
        if fragment in reason:
            return f"{remedy} (kubelet: {reason[-300:]})"
    return reason[-500:]


def make_cgroup_root(root: str) -> list[Path]:
    """Create `root` in every cgroup v1 hierarchy (the kubelet wants its cgroupRoot to exist); a new
    cpuset cgroup starts with no CPUs and no memory nodes, so it gets its parent's."""
    made = []
    for hierarchy in sorted(CGROUP_FS.iterdir()):
        if hierarchy.name == "unified" or not (hierarchy / "cgroup.procs").exists():
            continue
        path = hierarchy / root.lstrip("/")
        path.mkdir(exist_ok=True)
        made.append(path)
        if hierarchy.name == "cpuset":
            for name in ("cpuset.cpus", "cpuset.mems"):
                (path / name).write_text((hierarchy / name).read_text())
    return made


def remove_cgroup_root(root: str) -> None:
    """rmdir `root` and every cgroup below it in every hierarchy, leaves first (they must be empty of
    processes: the kubelet and the runtime are stopped, every container gone)."""
    for hierarchy in sorted(CGROUP_FS.iterdir()):
        top = hierarchy / root.lstrip("/")
        if not top.is_dir():
            continue
        for path in sorted(top.rglob("*"), key=lambda p: len(p.parts), reverse=True):
            if path.is_dir():
                with contextlib.suppress(OSError):
                    path.rmdir()
        with contextlib.suppress(OSError):
            top.rmdir()


@dataclass
class Kubelet:
    """The kubelet of node `name` (index `index` in the cluster); `start()` returns once it runs."""

    name: str
    workdir: Path
    bin_dir: Path  # the control plane's build: kubelet
    server: str  # the API server's URL
    pki: PKI
    node_ip: str
    pod_cidr: str
    runtime: str  # containerd's CRI endpoint, unix://...
    labels: dict[str, str]
    cluster_dns: str  # the cluster DNS server's address (CoreDNS on the bridge)
    fail_cgroup_v1: bool = False  # True: the kubelet's default, which refuses a cgroup v1 machine
    proc: subprocess.Popen | None = None

    @property
    def cgroup_root(self) -> str:
        """The cgroup subtree of this node's pods (in every cgroup v1 hierarchy)."""
        return f"/kwt-{self.name}"

    def start(self) -> Kubelet:
        self.workdir.mkdir(parents=True, exist_ok=True)
        make_cgroup_root(self.cgroup_root)
        client = self.pki.issue(
            f"kubelet-{self.name}", f"system:node:{self.name}", organization="system:nodes"
        )
        serving = self.pki.issue(
            f"kubelet-{self.name}-serving",
            f"system:node:{self.name}",
            alt_names=[f"DNS:{self.name}", f"IP:{self.node_ip}", "IP:127.0.0.1"],
        )
        kubeconfig = write_kubeconfig(
            self.workdir / "kubelet.kubeconfig", self.server, self.pki.ca.cert, f"system:node:{self.name}",
            client=client,
        )  # fmt: skip
        config = self.workdir / "kubelet.json"
        config.write_text(
            json.dumps(
                kubelet_configuration(
                    address=self.node_ip,
                    port=free_port(),
                    healthz_port=free_port(),
                    ca=self.pki.ca.cert,
                    serving_cert=serving.cert,
                    serving_key=serving.key,
                    runtime=self.runtime,
                    cgroup_root=self.cgroup_root,
                    pod_cidr=self.pod_cidr,
                    pod_logs=self.workdir / "pod-logs",
                    cluster_dns=self.cluster_dns,
                    fail_cgroup_v1=self.fail_cgroup_v1,
                )
            )
        )
        labels = ",".join(f"{k}={v}" for k, v in sorted(self.labels.items()))
        log = open(self.workdir / "kubelet.log", "ab")  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen(
            [
                str(self.bin_dir / "kubelet"),
                f"--config={config}",
                f"--kubeconfig={kubeconfig}",
                f"--root-dir={self.workdir / 'root'}",
                f"--hostname-override={self.name}",
                f"--node-ip={self.node_ip}",
                *([f"--node-labels={labels}"] if labels else []),
                "--v=1",
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.workdir,
            env={**os.environ, "PATH": f"{self.bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}"},
        )
        log.close()
        time.sleep(0.5)
        self.check()
        return self

    def check(self) -> None:
        """Raise KubeletError, in one line that says why and what it needs, if the kubelet exited."""
        if self.proc is None or self.proc.poll() is None:
            return
        raise KubeletError(f"the kubelet of {self.name} exited: {startup_failure(self.log_tail(200))}")

    def log_tail(self, lines: int = 40) -> str:
        return process.log_tail(self.workdir / "kubelet.log", lines)

    def stop(self) -> None:
        process.stop(self.proc, grace_s=20)
        self.proc = None
