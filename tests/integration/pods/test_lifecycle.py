"""Lifecycle hooks in the pod runner, as the kubelet runs them: preStop (exec, httpGet, sleep) before
SIGTERM within the grace period, a terminating pod still serving during its preStop and reported
as terminating meanwhile (deletionTimestamp; its EndpointSlice endpoint not ready, terminating);
hooks the runner does not run are refused by name."""

from __future__ import annotations

import textwrap
import time
from typing import Any

import httpx
from test_pod_runner import (
    NS,
    cluster,
    container_status,
    create_pod,
    delete_and_wait,
    get_pod,
    node_root,
    ready,
)

from keepwarm_testing.controlplane.cluster import ControlPlane

__all__ = ["cluster"]  # the module's control plane fixture, shared by name

# Serves HTTP on $PORT; every GET path and the SIGTERM are appended to $EVENTS, in order.
SERVER = textwrap.dedent(
    """
    import http.server, os, signal, sys
    events = os.environ["EVENTS"]
    def note(what):
        with open(events, "a") as f:
            f.write(what + "\\n")
    def on_term(*_):
        note("term")
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            note(self.path)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"up")
    note("up")
    http.server.HTTPServer(("0.0.0.0", int(os.environ["PORT"])), Handler).serve_forever()
    """
)


def server(name: str, port: int, pre_stop: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": name,
        "image": "x",
        "command": ["python3", "-c", SERVER],
        "env": [{"name": "PORT", "value": str(port)}, {"name": "EVENTS", "value": f"/out/{name}"}],
        "ports": [{"name": "http", "containerPort": port}],
        "readinessProbe": {"httpGet": {"path": "/ready", "port": port}, "periodSeconds": 1},
        "volumeMounts": [{"name": "out", "mountPath": "/out"}],
        "lifecycle": {"preStop": pre_stop},
    }


def hooked_pod(name: str, containers: list[dict[str, Any]], grace_s: int = 30) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "containers": containers,
            "terminationGracePeriodSeconds": grace_s,
            "volumes": [{"name": "out", "hostPath": {"path": f"/srv/{name}", "type": "DirectoryOrCreate"}}],
        },
    }


def events(cp: ControlPlane, pod: str, container: str) -> list[str]:
    path = node_root(cp) / "srv" / pod / container
    return [e for e in path.read_text().split() if e != "/ready"] if path.exists() else []


def test_exec_and_http_prestop_hooks_run_before_sigterm(cluster: ControlPlane) -> None:
    cp = cluster
    by_exec = server(
        "by-exec", 8080, {"exec": {"command": ["sh", "-c", "echo prestop-exec >> /out/by-exec"]}}
    )
    by_http = server("by-http", 8081, {"httpGet": {"path": "/prestop-http", "port": "http"}})
    create_pod(cp, hooked_pod("hooked", [by_exec, by_http]))
    cp.wait_for(lambda: ready(get_pod(cp, "hooked")), timeout_s=120, what="pod Ready")
    delete_and_wait(cp, "hooked")
    assert events(cp, "hooked", "by-exec") == ["up", "prestop-exec", "term"]
    assert events(cp, "hooked", "by-http") == ["up", "/prestop-http", "term"]


def endpoint_conditions(cp: ControlPlane, service: str) -> list[dict[str, bool]]:
    """The conditions of the service's endpoints, as the EndpointSlice controller publishes them."""
    selector = f"kubernetes.io/service-name={service}"
    slices = cp.http.get(f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices?labelSelector={selector}")
    return [e.get("conditions", {}) for s in slices.json()["items"] for e in s.get("endpoints") or []]


def test_a_pod_serves_through_its_prestop_sleep_while_reported_terminating(cluster: ControlPlane) -> None:
    """What an endpoints consumer sees: at once the pod has its deletionTimestamp and its endpoint
    turns not ready, terminating, still serving (so clients stop picking it), while its container
    runs and answers until the sleep is over; SIGTERM only then."""
    cp = cluster
    sleep_s = 10  # room for the EndpointSlice controller to publish the change on a loaded machine
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "sleeper"},
        "spec": {"selector": {"app": "sleeper"}, "ports": [{"port": 80, "targetPort": 8080}]},
    }
    assert cp.http.post(f"/api/v1/namespaces/{NS}/services", json=service).status_code == 201
    create_pod(cp, hooked_pod("sleeper", [server("web", 8080, {"sleep": {"seconds": sleep_s}})]))
    pod = cp.wait_for(lambda: (p := get_pod(cp, "sleeper")) and ready(p) and p, timeout_s=120, what="Ready")
    cp.wait_for(
        lambda: (
            endpoint_conditions(cp, "sleeper") == [{"ready": True, "serving": True, "terminating": False}]
        ),
        timeout_s=60,
        what="the pod's endpoint ready",
    )
    url = f"http://{pod['status']['podIP']}:8080/during"
    cp.kubectl("delete", "pod", "-n", NS, "sleeper", "--wait=false")
    deleted_at = time.monotonic()
    terminating = cp.wait_for(
        lambda: (p := get_pod(cp, "sleeper")) and p["metadata"].get("deletionTimestamp") and p,
        timeout_s=30,
        what="the pod marked terminating",
    )
    cp.wait_for(
        lambda: (
            endpoint_conditions(cp, "sleeper") == [{"ready": False, "serving": True, "terminating": True}]
        ),
        timeout_s=sleep_s,
        what="the endpoint terminating, not ready, still serving",
    )
    assert "running" in container_status(terminating)["state"]
    assert httpx.get(url, timeout=10).text == "up"  # still serving inside the preStop sleep
    cp.wait_for(lambda: get_pod(cp, "sleeper") is None, timeout_s=60, what="pod gone")
    assert time.monotonic() - deleted_at >= sleep_s  # SIGTERM waited for the hook
    assert events(cp, "sleeper", "web") == ["up", "/during", "term"]
    cp.kubectl("delete", "service", "-n", NS, "sleeper")


def test_hooks_the_runner_does_not_run_are_refused_by_name(cluster: ControlPlane) -> None:
    cp = cluster
    post_start = {
        "name": "c",
        "image": "x",
        "command": ["sleep", "600"],
        "lifecycle": {"postStart": {"exec": {"command": ["true"]}}},
    }
    tcp = {**post_start, "lifecycle": {"preStop": {"tcpSocket": {"port": 80}}}}
    for name, spec, word in (("post-start", post_start, "postStart"), ("tcp-hook", tcp, "tcpSocket")):
        create_pod(cp, {"metadata": {"name": name}, "spec": {"containers": [spec]}})

        def refused(pod: str = name) -> str | None:
            waiting = container_status(get_pod(cp, pod)).get("state", {}).get("waiting", {})
            return waiting.get("message") if waiting.get("reason") == "CreateContainerConfigError" else None

        assert word in cp.wait_for(refused, timeout_s=60, what=f"{name} refused")
        delete_and_wait(cp, name)
