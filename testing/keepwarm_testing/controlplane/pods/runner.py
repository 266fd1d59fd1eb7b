"""The kubelet stand-in's pod runner: pods bound to its nodes run as real processes (needs root).

    runner = PodRunner(root, api_port)      # creates the bridge; runner.bind(request) before pods come
    runner.add_node(name, index, ip)        # node `index` owns podCIDR runner.network.pod_cidr(index)
    runner.sync(pod)                        # from the pod watch: start, or begin deletion
    runner.stop()                           # kills every pod, removes bridge, namespaces, cgroups

The image is not pulled: the host's installed keepwarm (this interpreter's environment, first on PATH)
is every image's content; `status.containerStatuses[].image` still records the image asked for, and
`images` (images.py) gives an image's entrypoint, cmd, user and working directory.
Each node has its own root directory for hostPath volumes (see volumes.py). A pod is one
`PodWorker` thread (worker.py). The parts: network.py (bridge, namespaces, veths), cgroups.py,
volumes.py, env.py, probes.py, container.py + init.py (one container), status.py.
"""

from __future__ import annotations

import base64
import logging
import secrets
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from . import cgroups, network
from .env import DEFAULT_PATH
from .images import ImageConfig, repository
from .network import PodNetwork
from .worker import PodWorker

log = logging.getLogger("keepwarm.test.pods")
# The kubelet's _request: (method, path, body, merge=, ok=, raise_=) -> JSON or None.
Request = Callable[..., dict[str, Any] | None]


@dataclass(frozen=True)
class RunnerNode:
    name: str
    index: int  # podCIDR 10.Y.<index>.0/24
    ip: str  # the Node's InternalIP (hostIP of its pods)
    root: Path  # the node's filesystem root for hostPath volumes


class ClusterApi:
    """What a kubelet reads for its pods: ConfigMaps, Secrets and bound ServiceAccount tokens."""

    def __init__(self, request: Request) -> None:
        self.request = request

    def lookup(self, kind: str, namespace: str, name: str) -> dict[str, bytes] | None:
        plural = "configmaps" if kind == "ConfigMap" else "secrets"
        obj = self.request("GET", f"/api/v1/namespaces/{namespace}/{plural}/{name}", ok=(404,))
        if obj is None:
            return None
        if kind == "Secret":
            return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
        data = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
        data.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
        return data

    def token(self, pod: dict[str, Any], audience: str | None, expiration_s: int) -> str:
        meta = pod["metadata"]
        account = pod["spec"].get("serviceAccountName") or "default"
        spec: dict[str, Any] = {
            "expirationSeconds": max(600, expiration_s),
            "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": meta["name"], "uid": meta["uid"]},
        }
        if audience:
            spec["audiences"] = [audience]
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
        path = f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{account}/token"
        resp = self.request("POST", path, body, raise_=True)
        assert resp is not None
        return resp["status"]["token"]


class PodRunner:
    def __init__(self, root: Path, api_port: int, images: dict[str, ImageConfig] | None = None) -> None:
        self.root = root
        self.images = dict(images or {})  # image repository (no tag) -> its config (images.py)
        self.request: Request = self._unbound
        self.api = ClusterApi(self._call)
        self.network = PodNetwork()
        self.group = f"kwt-{secrets.token_hex(3)}"
        self.stopping = threading.Event()
        self.api_port = api_port
        self.image_path = f"{Path(sys.executable).parent}:{DEFAULT_PATH}"
        self._lock = threading.Lock()
        self._nodes: dict[str, RunnerNode] = {}
        self._workers: dict[str, PodWorker] = {}
        self._ran: set[str] = set()  # uid of every pod ever started here (for leftovers())
        self.network.setup()

    def bind(self, request: Request) -> None:
        """The kubelet's API call function, used for everything the runner reads and writes."""
        self.request = request

    def _call(self, *args: Any, **kwargs: Any) -> dict[str, Any] | None:
        return self.request(*args, **kwargs)

    @staticmethod
    def _unbound(*_: Any, **__: Any) -> dict[str, Any] | None:
        raise RuntimeError("PodRunner.bind() was not called")

    @property
    def service_env(self) -> dict[str, str]:
        """The `kubernetes` Service's variables, pointing at the API server through the bridge."""
        host, port = self.network.gateway, str(self.api_port)
        return {
            "KUBERNETES_SERVICE_HOST": host,
            "KUBERNETES_SERVICE_PORT": port,
            "KUBERNETES_SERVICE_PORT_HTTPS": port,
            "KUBERNETES_PORT": f"tcp://{host}:{port}",
            "KUBERNETES_PORT_443_TCP": f"tcp://{host}:{port}",
            "KUBERNETES_PORT_443_TCP_PROTO": "tcp",
            "KUBERNETES_PORT_443_TCP_PORT": port,
            "KUBERNETES_PORT_443_TCP_ADDR": host,
        }

    def add_node(self, name: str, index: int, ip: str) -> RunnerNode:
        node = RunnerNode(name, index, ip, self.root / "nodes" / name)
        node.root.mkdir(parents=True, exist_ok=True)
        with self._lock:
            self._nodes[name] = node
        return node

    def node(self, name: str) -> RunnerNode | None:
        with self._lock:
            return self._nodes.get(name)

    def sync(self, pod: dict[str, Any]) -> None:
        """A pod event from the watch: start a worker for a new pod, or begin its deletion."""
        node = self.node(pod["spec"].get("nodeName", ""))
        if node is None:
            return
        uid = pod["metadata"]["uid"]
        deleting = pod["metadata"].get("deletionTimestamp")
        with self._lock:
            worker = self._workers.get(uid)
            if worker is None and uid in self._ran and not deleting:
                return  # a late event of a pod that already ran here and is gone: never twice
            if worker is None:
                if deleting:
                    worker = None
                else:
                    worker = self._workers[uid] = PodWorker(self, node, pod)
                    self._ran.add(uid)
                    worker.start()
                    return
        if worker is None:  # never started here: nothing to stop
            self.finalize(pod)
        elif deleting:
            worker.request_delete(float(pod["metadata"].get("deletionGracePeriodSeconds", 30)))

    def forget(self, pod: dict[str, Any]) -> None:
        """The Pod object is gone (force-deleted): stop its containers at once."""
        with self._lock:
            worker = self._workers.get(pod["metadata"]["uid"])
        if worker is not None:
            worker.request_delete(0.0)

    def worker(self, namespace: str, name: str) -> PodWorker | None:
        with self._lock:
            return next(
                (w for w in self._workers.values() if (w.namespace, w.name) == (namespace, name)), None
            )

    def workers(self) -> list[PodWorker]:
        with self._lock:
            return list(self._workers.values())

    def cgroup_pids(self) -> set[int]:
        """Every process in any pod cgroup of this runner (empty once all pods are gone)."""
        found: set[int] = set()
        for procs in cgroups.CGROUP_ROOT.glob(f"*/{self.group}/*/cgroup.procs"):
            found |= {int(pid) for pid in procs.read_text().split()}
        return found

    def leftovers(self) -> list[str]:
        """What of this runner still exists on the machine: its bridge, its pods' namespaces and veths,
        its cgroups. Empty after stop(), and for the pods it ran, once they are gone."""
        with self._lock:
            ran = set(self._ran) - set(self._workers)
        found = network.existing(self.network.bridge if self.stopping.is_set() else "", ran)
        return found + [str(p) for p in cgroups.CGROUP_ROOT.glob(f"*/{self.group}/*") if p.name in ran]

    def finalize(self, pod: dict[str, Any]) -> None:
        """Every container has stopped: delete the Pod for good, as a kubelet does."""
        meta = pod["metadata"]
        body = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "gracePeriodSeconds": 0,
            "preconditions": {"uid": meta["uid"]},
        }
        self.request(
            "DELETE", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}", body, ok=(404, 409)
        )
        with self._lock:
            self._workers.pop(meta["uid"], None)

    def patch_status(self, pod: dict[str, Any], status: dict[str, Any]) -> bool:
        meta = pod["metadata"]
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status"
        return self.request("PATCH", path, {"status": status}, merge=True, ok=(404, 409)) is not None

    def image(self, reference: str) -> ImageConfig:
        return self.images.get(repository(reference), ImageConfig())

    def cgroup_for(self, uid: str) -> cgroups.PodCgroup:
        return cgroups.PodCgroup(self.group, uid)

    @staticmethod
    def pod_limits(pod: dict[str, Any]) -> cgroups.Limits:
        """Pod-level limits: the sum over containers, set only when every container has one."""
        limits = [c.get("resources", {}).get("limits", {}) for c in pod["spec"]["containers"]]
        memory = [int(parse_quantity(lim["memory"])) for lim in limits if "memory" in lim]
        cpu = [int(parse_quantity(lim["cpu"]) * 1000) for lim in limits if "cpu" in lim]
        return cgroups.Limits(
            memory_bytes=sum(memory) if len(memory) == len(limits) else None,
            cpu_millis=sum(cpu) if len(cpu) == len(limits) else None,
        )

    def stop(self) -> None:
        """Kill every pod at once (no grace), then remove the bridge and the cgroup parent."""
        self.stopping.set()
        with self._lock:
            workers = list(self._workers.values())
            self._workers.clear()
        for worker in workers:
            worker.delete_requested.set()
        for worker in workers:
            worker.thread.join(timeout=30)
        cgroups.remove_group(self.group)
        self.network.teardown()
