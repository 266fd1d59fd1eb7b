"""A status-only kubelet stand-in: fake GPU nodes that stay Ready, and pods on them that run without
containers. Real pods run on real nodes (keepwarm_testing.node); this one stays for what real nodes
cannot hold on one machine: hundreds of pods for the operator's scale benchmark and the operator tests
that only need pods' status.

What it does, per node it owns, the way a real kubelet would look from the API server:
  1. registers the Node (labels, `nvidia.com/gpu` capacity, Ready condition, addresses);
  2. renews the node's Lease in `kube-node-lease` so the node lifecycle controller never taints it;
  3. watches pods bound to its nodes: a new pod becomes Running (and Ready unless told otherwise)
     with an IP; a pod marked for deletion is deleted for good (grace period 0), as a kubelet does
     once its containers stop.
Nothing runs: containers are only status, cheap enough for hundreds of pods.
Talks plain JSON over httpx (admin client certificate), not through keepwarm_api.kube: it stands in
for the cluster, not for keepwarm, so a fault in keepwarm's own client cannot hide on both sides of a
test.
"""

from __future__ import annotations

import json
import logging
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

import httpx

log = logging.getLogger("keepwarm.test.kubelet")

KUBE_VERSION = "v1.37.2"
LEASE_NAMESPACE = "kube-node-lease"
FAKE_NODE_ANNOTATION = "keepwarm.dev/fake-node"
POD_CONDITIONS = ("PodReadyToStartContainers", "Initialized", "Ready", "ContainersReady", "PodScheduled")


def _now(micro: bool = False) -> str:
    fmt = "%Y-%m-%dT%H:%M:%S.%fZ" if micro else "%Y-%m-%dT%H:%M:%SZ"
    return datetime.now(UTC).strftime(fmt)


@dataclass
class FakeNode:
    name: str  # Node name, also its hostname label
    ip: str  # InternalIP reported in status.addresses
    index: int  # 1-based, used to allocate pod IPs
    heartbeat: bool = True  # False stops lease renewals (the node goes NotReady after the grace period)
    pods_started: int = 0  # pods this node has marked Running so far


@dataclass
class KubeletStats:
    pods_started: int = 0  # pods marked Running
    pods_deleted: int = 0  # pods finalised after a deletion request
    errors: int = 0  # failed API calls (see the kubelet log)
    last_error: str = ""
    started_at: float = field(default_factory=time.monotonic)


class FakeKubelet:
    """Plays the kubelet for every node added through `add_node`; runs two daemon threads."""

    def __init__(
        self,
        server: str,
        tls: ssl.SSLContext,
        *,
        lease_seconds: int = 40,
        heartbeat_s: float = 10.0,
    ) -> None:
        self._http = httpx.Client(base_url=server, verify=tls, timeout=30.0)
        self._watch_http = httpx.Client(base_url=server, verify=tls, timeout=httpx.Timeout(30.0, read=60.0))
        self._lock = threading.Lock()
        self._nodes: dict[str, FakeNode] = {}
        self._next_index = 1
        self._stop = threading.Event()
        self.lease_seconds = lease_seconds
        self.heartbeat_s = heartbeat_s
        self.stats = KubeletStats()
        # Decides whether a freshly started pod reports Ready (default: always).
        self.ready: Callable[[dict], bool] = lambda pod: True
        self._threads = [
            threading.Thread(target=self._watch_pods, name="fake-kubelet-pods", daemon=True),
            threading.Thread(target=self._heartbeats, name="fake-kubelet-leases", daemon=True),
        ]

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=15)
        self._http.close()
        self._watch_http.close()

    @property
    def node_names(self) -> list[str]:
        with self._lock:
            return list(self._nodes)

    # -- nodes -----------------------------------------------------------------------------------
    def add_node(
        self,
        name: str,
        *,
        labels: dict[str, str] | None = None,
        gpus: int = 8,
        taints: list[dict] | None = None,
        cpu: str = "64",
        memory: str = "512Gi",
    ) -> FakeNode:
        """Register a Ready GPU node; returns once the Node and its Lease exist."""
        with self._lock:
            index = self._next_index
            self._next_index += 1
            node = FakeNode(name=name, ip=f"172.18.{index // 250}.{index % 250 + 1}", index=index)
            self._nodes[name] = node
        all_labels = {
            "kubernetes.io/hostname": name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            "nvidia.com/gpu.present": "true",
            "nvidia.com/gpu.count": str(gpus),
            **(labels or {}),
        }
        resources = {"cpu": cpu, "memory": memory, "pods": "110", "ephemeral-storage": "1Ti"}
        if gpus:
            resources["nvidia.com/gpu"] = str(gpus)
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "labels": all_labels, "annotations": {FAKE_NODE_ANNOTATION: "true"}},
            "spec": {"taints": taints or []},
        }
        created = self._request("POST", "/api/v1/nodes", body)
        self._request(
            "PATCH",
            f"/api/v1/nodes/{name}/status",
            {"status": self._node_status(node, resources)},
            merge=True,
        )
        lease = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": name,
                "namespace": LEASE_NAMESPACE,
                "ownerReferences": [
                    {"apiVersion": "v1", "kind": "Node", "name": name, "uid": created["metadata"]["uid"]}
                ],
            },
            "spec": {
                "holderIdentity": name,
                "leaseDurationSeconds": self.lease_seconds,
                "renewTime": _now(True),
            },
        }
        self._request("POST", f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases", lease)
        return node

    def _node_status(self, node: FakeNode, resources: dict[str, str]) -> dict:
        now = _now()
        healthy = {
            "MemoryPressure": "KubeletHasSufficientMemory",
            "DiskPressure": "KubeletHasNoDiskPressure",
            "PIDPressure": "KubeletHasSufficientPID",
        }
        conditions = [
            {
                "type": t,
                "status": "False",
                "reason": r,
                "message": "fake kubelet",
                "lastHeartbeatTime": now,
                "lastTransitionTime": now,
            }
            for t, r in healthy.items()
        ]
        conditions.append(
            {
                "type": "Ready",
                "status": "True",
                "reason": "KubeletReady",
                "message": "fake kubelet is posting ready status",
                "lastHeartbeatTime": now,
                "lastTransitionTime": now,
            }
        )
        return {
            "capacity": resources,
            "allocatable": resources,
            "conditions": conditions,
            "addresses": [
                {"type": "InternalIP", "address": node.ip},
                {"type": "Hostname", "address": node.name},
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {
                "machineID": f"fake-{node.index}",
                "systemUUID": f"fake-{node.index}",
                "bootID": f"fake-{node.index}",
                "kernelVersion": "6.8.0-fake",
                "osImage": "keepwarm fake node",
                "containerRuntimeVersion": "fake://1.0",
                "kubeletVersion": KUBE_VERSION,
                "kubeProxyVersion": "",
                "operatingSystem": "linux",
                "architecture": "amd64",
            },
        }

    def remove_node(self, name: str, *, delete_pods: bool = True) -> None:
        """Forget a node and delete its Node object (its Lease goes by garbage collection).

        delete_pods=True also force-deletes the pods bound to it, as if the node had been drained;
        otherwise they wait for the pod garbage collector (40 s quarantine, checked every 20 s), as
        for a node that vanished. The Node goes first: deleting a DaemonSet pod while its node still
        exists makes the DaemonSet controller put a new one there, which only the collector would then
        remove. Its informers may still lag the deletion, so the sweep repeats until the node has
        stayed empty for `settle_s`.
        """
        with self._lock:
            self._nodes.pop(name, None)
        self._request("DELETE", f"/api/v1/nodes/{name}", ok=(404,))
        if not delete_pods:
            return
        settle_s, deadline = 2.0, time.monotonic() + 30.0
        empty_since: float | None = None
        while time.monotonic() < deadline:
            pods = self._request("GET", f"/api/v1/pods?fieldSelector=spec.nodeName={name}")["items"]
            for pod in pods:
                self._delete_pod(pod)
            now = time.monotonic()
            if pods:
                empty_since = None
            elif empty_since is None:
                empty_since = now
            elif now - empty_since >= settle_s:
                return
            time.sleep(0.25)

    def set_heartbeat(self, name: str, alive: bool) -> None:
        """Stop (or resume) a node's lease renewals: a stopped node turns NotReady after the grace period."""
        with self._lock:
            self._nodes[name].heartbeat = alive

    def set_pod_ready(self, namespace: str, name: str, ready: bool) -> None:
        """Flip a running pod's readiness, as a failing or recovering readiness probe would."""
        pod = self._request("GET", f"/api/v1/namespaces/{namespace}/pods/{name}")
        status = self._running_status(pod, ready=ready)
        self._request(
            "PATCH", f"/api/v1/namespaces/{namespace}/pods/{name}/status", {"status": status}, merge=True
        )

    # -- the two loops ---------------------------------------------------------------------------
    def _heartbeats(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            with self._lock:
                alive = [n.name for n in self._nodes.values() if n.heartbeat]
            for name in alive:
                if self._stop.is_set():
                    return
                path = f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases/{name}"
                self._request("PATCH", path, {"spec": {"renewTime": _now(True)}}, merge=True, ok=(404,))

    def _watch_pods(self) -> None:
        rv = ""
        while not self._stop.is_set():
            try:
                if not rv:
                    listing = self._request(
                        "GET", "/api/v1/pods?fieldSelector=spec.nodeName!%3D", raise_=True
                    )
                    for pod in listing["items"]:
                        self._handle(pod)
                    rv = listing["metadata"]["resourceVersion"]
                params = {
                    "watch": "1",
                    "resourceVersion": rv,
                    "allowWatchBookmarks": "true",
                    "timeoutSeconds": "10",
                    "fieldSelector": "spec.nodeName!=",
                }
                with self._watch_http.stream("GET", "/api/v1/pods", params=params) as resp:
                    resp.raise_for_status()
                    for line in resp.iter_lines():
                        if self._stop.is_set():
                            return
                        if not line:
                            continue
                        event = json.loads(line)
                        obj = event["object"]
                        if event["type"] == "ERROR":
                            rv = ""  # usually 410 Gone: relist
                            break
                        rv = obj["metadata"].get("resourceVersion", rv)
                        if event["type"] in ("ADDED", "MODIFIED"):
                            self._handle(obj)
            except Exception as exc:
                if self._stop.is_set():
                    return
                self._record_error(f"pod watch: {exc!r}")
                rv = ""
                self._stop.wait(1.0)

    def _handle(self, pod: dict) -> None:
        with self._lock:
            node = self._nodes.get(pod["spec"].get("nodeName", ""))
        if node is None:
            return
        if pod["metadata"].get("deletionTimestamp"):
            self._delete_pod(pod)
            return
        if pod.get("status", {}).get("phase") in ("Running", "Succeeded", "Failed"):
            return
        with self._lock:
            node.pods_started += 1
            self.stats.pods_started += 1
            n = self.stats.pods_started
        ip = node.ip if pod["spec"].get("hostNetwork") else f"10.244.{n // 250}.{n % 250 + 1}"
        status = self._running_status(pod, ready=self.ready(pod), pod_ip=ip, host_ip=node.ip)
        meta = pod["metadata"]
        self._request(
            "PATCH",
            f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
            {"status": status},
            merge=True,
            ok=(404, 409),
        )

    def _running_status(
        self, pod: dict, *, ready: bool, pod_ip: str | None = None, host_ip: str | None = None
    ) -> dict:
        now = _now()
        old = pod.get("status", {})
        pod_ip = pod_ip or old.get("podIP")
        host_ip = host_ip or old.get("hostIP")
        started = old.get("startTime", now)
        conditions = [
            {
                "type": t,
                "status": "True" if ready or t not in ("Ready", "ContainersReady") else "False",
                "lastTransitionTime": now,
            }
            for t in POD_CONDITIONS
        ]
        containers = [
            {
                "name": c["name"],
                "image": c.get("image", ""),
                "imageID": f"fake://{c.get('image', '')}",
                "containerID": f"fake://{pod['metadata']['uid']}/{c['name']}",
                "ready": ready,
                "started": True,
                "restartCount": 0,
                "state": {"running": {"startedAt": started}},
            }
            for c in pod["spec"]["containers"]
        ]
        inits = [
            {
                "name": c["name"],
                "image": c.get("image", ""),
                "imageID": f"fake://{c.get('image', '')}",
                "ready": True,
                "restartCount": 0,
                "state": {
                    "terminated": {
                        "exitCode": 0,
                        "reason": "Completed",
                        "startedAt": started,
                        "finishedAt": started,
                    }
                },
            }
            for c in pod["spec"].get("initContainers", [])
        ]
        status = {
            "phase": "Running",
            "conditions": conditions,
            "containerStatuses": containers,
            "startTime": started,
            "hostIP": host_ip,
            "hostIPs": [{"ip": host_ip}],
            "podIP": pod_ip,
            "podIPs": [{"ip": pod_ip}],
        }
        if inits:
            status["initContainerStatuses"] = inits
        return status

    def _delete_pod(self, pod: dict) -> None:
        meta = pod["metadata"]
        body = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "gracePeriodSeconds": 0,
            "preconditions": {"uid": meta["uid"]},
        }
        done = self._request(
            "DELETE", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}", body, ok=(404, 409)
        )
        if done is not None:
            with self._lock:
                self.stats.pods_deleted += 1

    # -- HTTP ------------------------------------------------------------------------------------
    def _request(
        self,
        method: str,
        path: str,
        body: dict | None = None,
        *,
        merge: bool = False,
        ok: tuple[int, ...] = (),
        raise_: bool = False,
    ) -> dict | None:
        """One API call; statuses in `ok` return None quietly, other failures are logged (or raised)."""
        headers = {"Content-Type": "application/merge-patch+json" if merge else "application/json"}
        try:
            resp = self._http.request(
                method, path, content=json.dumps(body) if body is not None else None, headers=headers
            )
        except httpx.HTTPError as exc:
            if raise_ or method == "POST":
                raise
            self._record_error(f"{method} {path}: {exc!r}")
            return None
        if resp.status_code in ok:
            return None
        if resp.status_code >= 400:
            msg = f"{method} {path}: HTTP {resp.status_code}: {resp.text[:500]}"
            if raise_ or method == "POST":
                raise RuntimeError(msg)
            self._record_error(msg)
            return None
        return resp.json()

    def _record_error(self, msg: str) -> None:
        log.warning("%s", msg)
        with self._lock:
            self.stats.errors += 1
            self.stats.last_error = msg
