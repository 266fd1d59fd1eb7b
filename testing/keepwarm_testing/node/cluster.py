"""The real nodes of one test cluster and what they share: the bridge, the images, the registry serving
them, kube-proxy, the cluster DNS (CoreDNS) and, on request, the LeaderWorkerSet controller
(node/addons.py). `ControlPlane(run_pods=True)` owns one (controlplane/cluster.py).

Order matters: `prepare()` runs before the API server starts (the bridge's address is what it
advertises, and the images must be in the registry before a node pulls them), `start()` after it, and
`add()` registers a node and waits for it to be Ready (CoreDNS runs from `start()` on, since every
kubelet names it as its cluster DNS). One such cluster runs on a machine at a time (a
lock): kube-proxy's iptables chains and the hostPaths pods mount belong to the whole machine.

The images are the Dockerfile's targets (node/images.py), published under the names a user's cluster
would pull: the chart's operator image and the CPU runtime image, both as `ghcr.io/keepwarm/...`, which
every node resolves to the local registry.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import sys
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import yaml

from keepwarm_api.inferencedeployment import DEFAULT_CPU_IMAGE

from ..controlplane.pki import PKI
from .addons import CoreDNS, LwsManager
from .build import build_node_components
from .images import BuiltImages, build_images, push
from .kubelet import KubeletError
from .network import Bridge
from .node import NodeCluster, RealNode
from .proxy import KubeProxy
from .registry import LocalRegistry
from .strays import stop_strays

if TYPE_CHECKING:
    from ..controlplane.cluster import ControlPlane

CHART = Path(__file__).resolve().parents[3] / "charts" / "keepwarm"
MACHINE_LOCK = Path("/run/keepwarm-test-nodes.lock")


class NodeSetError(RuntimeError):
    """A real node did not come up; the message names it and carries its components' log tails."""


def operator_image() -> str:
    """The operator image the chart installs by default: its repository at the chart's appVersion."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    return f"{values['image']['repository']}:{values['image']['tag'] or chart['appVersion']}"


def registry_path(image: str) -> str:
    """ghcr.io/keepwarm/x:1 -> keepwarm/x:1: where a mirrored reference lives in the local registry."""
    first, _, rest = image.partition("/")
    return rest if ("." in first or ":" in first) and rest else image


class NodeSet:
    def __init__(self, workdir: Path, service_cidr: str) -> None:
        self.workdir, self.service_cidr = workdir, service_cidr
        self.bridge = Bridge()
        self.registry = LocalRegistry(workdir / "registry")
        self.nodes: dict[str, RealNode] = {}
        self.images: BuiltImages | None = None
        self.published: dict[str, str] = {}  # image reference the cluster uses -> local image
        self.kube_proxy: KubeProxy | None = None
        self.dns: CoreDNS | None = None
        self.lws: LwsManager | None = None
        self._cluster: NodeCluster | None = None
        self._lock: IO[str] | None = None
        self._node_bin: Path | None = None

    # -- life cycle ------------------------------------------------------------------------------------

    def prepare(self, lock_timeout_s: float = 1800.0) -> NodeSet:
        if os.geteuid() != 0:
            raise NodeSetError("real nodes need root (containerd, runc, network namespaces, cgroups)")
        self._take_machine(lock_timeout_s)
        KubeProxy.remove_chains()  # a crashed run's, if any: the machine is this cluster's now
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._node_bin = build_node_components()
        self.images = build_images(self.workdir / "images.log")
        self.bridge.setup()
        self.registry.start()
        self.publish(self.images.operator, operator_image())
        self.publish(self.images.runtime, DEFAULT_CPU_IMAGE)
        self.publish(self.images.pause, "keepwarm/pause:" + self.images.pause.rsplit(":", 1)[1])
        return self

    def start(self, server: str, pki: PKI, control_plane_bin: Path) -> None:
        assert self.images is not None and self._node_bin is not None, "prepare() first"
        node_server = server.replace("127.0.0.1", self.bridge.gateway)  # through the forwarder
        self._cluster = NodeCluster(
            server=node_server,
            pki=pki,
            bridge=self.bridge,
            service_cidr=self.service_cidr,
            registry=self.registry.host,
            sandbox=f"{self.registry.host}/{self._pause_path()}",
            control_plane_bin=control_plane_bin,
            node_bin=self._node_bin,
            pull=tuple(ref for ref in self.published if "/pause:" not in ref),
        )
        self.dns = CoreDNS(self.workdir / "coredns", self._node_bin, server, pki, self.bridge.gateway)
        self.dns.start()  # held first: a CoreDNS that never became ready is stopped, its log kept

    def install_lws(self, cp: ControlPlane) -> LwsManager:
        """The LeaderWorkerSet CRDs, webhooks and controller (node/addons.py); a second call finds them
        installed. The controller stops with the cluster."""
        assert self._cluster is not None and self._node_bin is not None, "start() first"
        if self.lws is None:
            self.lws = LwsManager(self.workdir / "lws", self._node_bin, cp.server, self._cluster.pki)
        return self.lws.install(cp)

    def _pause_path(self) -> str:
        return next(registry_path(ref) for ref in self.published if "/pause:" in ref)

    def publish(self, local: str, reference: str) -> str:
        """Put a local image in the registry as `reference` (e.g. a second tag a test rolls out to); a
        node started afterwards pulls it, one started before pulls it when a pod needs it."""
        push(local, self.registry, registry_path(reference))
        self.published[reference] = local
        return reference

    def add(
        self, cp: ControlPlane, name: str, *, labels: dict[str, str] | None, gpus: int,
        taints: list[dict] | None, timeout_s: float = 300.0,
    ) -> RealNode:  # fmt: skip
        """Start node `name`, wait for it to be Ready, give it its GPUs (advertised only) and taints."""
        assert self._cluster is not None, "start() first"
        all_labels = {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.count": str(gpus), **(labels or {})}
        node = RealNode(name, len(self.nodes) + 1, self.workdir / name, self._cluster, all_labels)
        self.nodes[name] = node
        try:
            node.start()
            deadline = time.monotonic() + timeout_s
            while not _ready(cp.http.get(f"/api/v1/nodes/{name}").json()):
                assert node.kubelet is not None
                node.kubelet.check()  # a kubelet that exited says why at once
                if time.monotonic() > deadline:
                    raise TimeoutError(f"not Ready after {timeout_s:.0f} s")
                time.sleep(0.25)
        except KubeletError as exc:
            raise NodeSetError(f"node {name}: {exc}") from None
        except Exception as exc:
            raise NodeSetError(f"node {name} did not come up: {exc}\n{node.log_tail()}") from exc
        if gpus:
            cp.http.patch(
                f"/api/v1/nodes/{name}/status",
                json={"status": {"capacity": {"nvidia.com/gpu": str(gpus)}}},
                headers={"Content-Type": "application/merge-patch+json"},
            ).raise_for_status()
        if taints:
            cp.http.patch(
                f"/api/v1/nodes/{name}",
                json={"spec": {"taints": taints}},
                headers={"Content-Type": "application/merge-patch+json"},
            ).raise_for_status()
        if self.kube_proxy is None:
            self.kube_proxy = KubeProxy(
                self.workdir / "kube-proxy", self._cluster.control_plane_bin, self._cluster.server,
                self._cluster.pki, name, self.bridge.cidr,
            ).start()  # fmt: skip
        return node

    def stop(self, keep_logs: Path | None = None) -> None:
        if keep_logs is not None:
            self._keep_logs(keep_logs)
        if self.lws is not None:
            self.lws.stop()
        for node in reversed(list(self.nodes.values())):
            node.stop()
        if self.dns is not None:
            self.dns.stop()
        if self.kube_proxy is not None:
            self.kube_proxy.stop()
        KubeProxy.remove_chains()
        self.registry.stop()
        self.bridge.teardown()
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    # -- looking at pods -----------------------------------------------------------------------------

    def node_of(self, pod: dict[str, Any]) -> RealNode:
        return self.nodes[pod["spec"]["nodeName"]]

    def container_pid(self, pod: dict[str, Any], container: str | None = None) -> int:
        """The host PID of a running container's first process (the pod's first container by default)."""
        statuses = pod.get("status", {}).get("containerStatuses", [])
        status = next(s for s in statuses if container in (None, s["name"]))
        return self.node_of(pod).container_pid(status["containerID"])

    def pod_remains(self) -> list[str]:
        """What pods that ran still hold on the running nodes (RealNode.pod_remains) and the bridge."""
        found = [f"{name}: {item}" for name, node in self.nodes.items() for item in node.pod_remains()]
        return found + [f"bridge port {port}" for port in self.bridge.ports()]

    def leftovers(self) -> list[str]:
        """What the nodes left on the machine after stop(): [] when clean."""
        found = [f"{name}: {item}" for name, node in self.nodes.items() for item in node.leftovers()]
        found += [f"bridge port {port}" for port in self.bridge.ports()]
        found += KubeProxy.leftovers()
        return found

    # -- internals -----------------------------------------------------------------------------------

    def _take_machine(self, timeout_s: float) -> None:
        lock = open(MACHINE_LOCK, "w")  # noqa: SIM115 - held until stop()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    lock.close()
                    raise NodeSetError(f"another test cluster with real nodes holds {MACHINE_LOCK}") from None
                time.sleep(1.0)
        self._lock = lock
        if found := stop_strays():  # the lock is ours: whatever runs now was left by a killed cluster
            print(f"stopped what an earlier test cluster left running: {', '.join(found)}", file=sys.stderr)

    def _keep_logs(self, logs: Path) -> None:
        """Copy the nodes' component logs, the add-ons' and every container log beside the control
        plane's."""
        for addon in (self.dns, self.lws):
            if addon is not None and addon.log.exists():
                with contextlib.suppress(OSError):
                    shutil.copyfile(addon.log, logs / addon.log.name)
        for name, node in self.nodes.items():
            target = logs / "nodes" / name
            target.mkdir(parents=True, exist_ok=True)
            for log in [*node.workdir.rglob("*.log"), *(node.workdir / "kubelet").glob("*.log")]:
                with contextlib.suppress(OSError):
                    shutil.copyfile(log, target / log.name)
            for log in (node.workdir / "kubelet" / "pod-logs").glob("*/*/*.log"):
                with contextlib.suppress(OSError):
                    dest = target / "pods" / "_".join(log.parts[-3:])
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(log, dest)


def _ready(node: dict[str, Any]) -> bool:
    if node.get("kind") != "Node":  # a Status: the kubelet has not registered the node yet
        return False
    conditions = node.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
