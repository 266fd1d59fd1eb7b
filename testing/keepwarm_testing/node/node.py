"""A real Kubernetes node on this machine: containerd with runc and the CNI bridge plugin, and the kubelet.

Pods run as a user's cluster runs them: the kubelet asks containerd (CRI) for a sandbox and
containers, runc starts them from images pulled out of the local registry, CNI gives them an address
on the cluster's bridge (node/network.py). Each node has its own address on the bridge (10.Y.n.1),
its own containerd, kubelet root and cgroup subtree, so several nodes share one machine the way kind
runs several in one host.

`stop()` leaves nothing behind: the kubelet first, then every sandbox removed through the CRI (which
tears down their networks and mounts), then containerd; what is still there afterwards (a shim, a
mount, a cgroup, a network namespace, an address) is what `leftovers()` names.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from ..controlplane.pki import PKI
from .containerd import Containerd
from .kubelet import Kubelet, remove_cgroup_root
from .network import Bridge, cni_config, ip

CGROUP_FS = Path("/sys/fs/cgroup")
NETNS_DIR = Path("/var/run/netns")


class NodeError(RuntimeError):
    """A node component failed; the message carries the component's log tail."""


@dataclass
class NodeCluster:
    """What every node of one cluster shares."""

    server: str  # the API server's URL as the nodes reach it
    pki: PKI
    bridge: Bridge
    service_cidr: str
    registry: str  # host:port of the local registry
    sandbox: str  # the pause image's reference in it
    control_plane_bin: Path  # the kubelet
    node_bin: Path  # containerd, runc, CNI plugins, crictl, the add-ons (node/build.sh)
    pull: tuple[str, ...] = ()  # images every node pulls at start (their tags may have moved)


@dataclass
class RealNode:
    name: str
    index: int  # 1..254: the node's address 10.Y.index.1 and pod range 10.Y.index.0/24
    workdir: Path
    cluster: NodeCluster
    labels: dict[str, str] = field(default_factory=dict)
    containerd: Containerd | None = None
    kubelet: Kubelet | None = None
    _netns_before: set[str] = field(default_factory=set)

    @property
    def address(self) -> str:
        return f"10.{self.cluster.bridge.second_octet}.{self.index}.1"

    def start(self) -> RealNode:
        cluster = self.cluster
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._netns_before = _netns()
        ip("addr", "add", f"{self.address}/16", "dev", cluster.bridge.name)
        cni = self.workdir / "cni"
        cni.mkdir(exist_ok=True)
        conflist = cni_config(
            cluster.bridge, self.name, self.index, cluster.service_cidr, self.workdir / "ipam"
        )
        (cni / "10-keepwarm.conflist").write_text(json.dumps(conflist, indent=1))
        self.containerd = Containerd(
            self.name, self.workdir / "containerd", cluster.node_bin, cni, cluster.registry, cluster.sandbox
        ).start()
        self.refresh_images((cluster.sandbox, *cluster.pull))
        self.kubelet = Kubelet(
            self.name, self.workdir / "kubelet", cluster.control_plane_bin, cluster.server, cluster.pki,
            self.address, cluster.bridge.pod_cidr(self.index), self.containerd.endpoint, self.labels,
            cluster.bridge.gateway,
        ).start()  # fmt: skip
        return self

    def refresh_images(self, references: tuple[str, ...]) -> None:
        """Pull the cluster's images (a tag may name a new build since this node's root last ran) and
        remove every other image the node holds, so its disk holds one copy of each."""
        keep = set()
        for reference in references:
            self.crictl("pull", reference, timeout=1800)
            keep.add(json.loads(self.crictl("inspecti", "-o", "json", reference).stdout)["status"]["id"])
        for image in json.loads(self.crictl("images", "-o", "json").stdout)["images"]:
            if image["id"] not in keep:
                self.crictl("rmi", image["id"], check=False)

    def crictl(
        self, *args: str, timeout: float = 120.0, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """cri-tools' crictl on this node's containerd, as an operator on the node would use it."""
        assert self.containerd is not None
        endpoint = self.containerd.endpoint
        cmd = [
            str(self.cluster.node_bin / "crictl"),
            "--runtime-endpoint",
            endpoint,
            "--image-endpoint",
            endpoint,
        ]
        proc = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise NodeError(
                f"crictl {' '.join(args)} on {self.name}: {proc.stderr.strip() or proc.stdout.strip()}"
            )
        return proc

    def container_pid(self, container_id: str) -> int:
        """The host PID of a running container's first process (`containerd://<id>` or the bare id)."""
        info = json.loads(self.crictl("inspect", container_id.removeprefix("containerd://")).stdout)
        return int(info["info"]["pid"])

    def log_tail(self) -> str:
        parts = []
        if self.kubelet is not None:
            parts.append(f"kubelet:\n{self.kubelet.log_tail()}")
        if self.containerd is not None:
            parts.append(f"containerd:\n{self.containerd.log_tail()}")
        return "\n".join(parts)

    def stop(self) -> None:
        """Stop the kubelet, remove every pod sandbox through the CRI, stop containerd, clean up."""
        if self.kubelet is not None:
            self.kubelet.stop()
        if self.containerd is not None and self.containerd.proc is not None:
            with contextlib.suppress(NodeError, subprocess.TimeoutExpired):
                self.crictl("rmp", "--force", "--all", timeout=180)
            self.containerd.stop()
        for mount in reversed(self.mounts()):
            subprocess.run(["umount", "--lazy", mount], capture_output=True)
        if self.kubelet is not None:
            remove_cgroup_root(self.kubelet.cgroup_root)
        ip("addr", "del", f"{self.address}/16", "dev", self.cluster.bridge.name, check=False)

    # -- what a node leaves behind ---------------------------------------------------------------------

    def roots(self) -> list[Path]:
        paths = [self.workdir]
        if self.containerd is not None and getattr(self.containerd, "root", None) is not None:
            paths.append(self.containerd.root)
        return paths

    def mounts(self) -> list[str]:
        """Mount points under this node's folders (containerd's root included), in mount order."""
        roots = [str(p) + "/" for p in self.roots()]
        found = []
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            point = line.split()[4].replace("\\040", " ")
            if any(point.startswith(root) for root in roots):
                found.append(point)
        return found

    def cgroup_dirs(self) -> list[Path]:
        """This node's cgroup subtree in every hierarchy (`cgroupRoot`)."""
        if self.kubelet is None:
            return []
        rel = self.kubelet.cgroup_root.lstrip("/")
        return [d / rel for d in sorted(CGROUP_FS.iterdir()) if (d / rel).is_dir()]

    def shims(self) -> list[int]:
        """containerd shims serving this node's containerd (they outlive containerd by design)."""
        if self.containerd is None:
            return []
        socket = str(self.containerd.socket)
        pids = []
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                with contextlib.suppress(OSError):
                    argv = (proc / "cmdline").read_bytes().split(b"\0")
                    if b"containerd-shim" in argv[0] and socket.encode() in argv:
                        pids.append(int(proc.name))
        return pids

    def pod_remains(self) -> list[str]:
        """What pods that ran here still hold while the node runs: sandboxes, the kubelet's pod folders
        (volumes, logs), mounts under them, pod cgroups. [] once every pod is gone."""
        found = [f"sandbox {s}" for s in self.crictl("pods", "--quiet").stdout.split()]
        if self.kubelet is not None:
            pods = self.kubelet.workdir / "root" / "pods"
            found += [f"pod folder {d.name}" for d in sorted(pods.glob("*"))] if pods.is_dir() else []
            found += [f"mount {m}" for m in self.mounts() if m.startswith(str(pods) + "/")]
            logs = self.kubelet.workdir / "pod-logs"
            found += [f"pod logs {d.name}" for d in sorted(logs.glob("*"))] if logs.is_dir() else []
        found += [
            f"cgroup {d}" for top in self.cgroup_dirs() for d in sorted(top.rglob("pod*")) if d.is_dir()
        ]
        return found

    def leftovers(self) -> list[str]:
        """What this node still holds on the machine; [] once stopped cleanly."""
        found = [f"shim pid {pid}" for pid in self.shims()]
        found += [f"mount {m}" for m in self.mounts()]
        found += [f"cgroup {d}" for d in self.cgroup_dirs()]
        found += [f"netns {n}" for n in sorted(_netns() - self._netns_before)]
        if f" {self.address}/" in ip("-o", "addr", "show", "dev", self.cluster.bridge.name, check=False):
            found.append(f"address {self.address}")
        return found


def _netns() -> set[str]:
    return {p.name for p in NETNS_DIR.iterdir()} if NETNS_DIR.is_dir() else set()
