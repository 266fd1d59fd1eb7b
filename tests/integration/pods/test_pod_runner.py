"""Pods that run: the kubelet stand-in's pod runner against the real control plane (root only).

Each test creates Pods through the API server and looks at them as a user would (status, their
output on a hostPath, their IP), and at the machine (namespaces, veths, cgroups) once they are gone.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from keepwarm_testing.controlplane.build import ControlPlaneBuildError, build_control_plane
from keepwarm_testing.controlplane.cluster import ControlPlane
from tests.running_pods import NEEDS_ROOT

pytestmark = [pytest.mark.slow, NEEDS_ROOT]
NS = "pods-test"


@pytest.fixture(scope="module")
def cluster() -> Iterator[ControlPlane]:
    try:
        bin_dir = build_control_plane()
    except ControlPlaneBuildError as exc:
        pytest.fail(str(exc), pytrace=False)
    with ControlPlane(bin_dir, run_pods=True) as cp:
        cp.add_gpu_nodes(1)
        cp.kubectl("create", "namespace", NS)
        cp.wait_for(
            lambda: cp.http.get(f"/api/v1/namespaces/{NS}/serviceaccounts/default").status_code == 200,
            what="the namespace's default ServiceAccount",
        )
        yield cp
        runner = cp.pods
    assert runner is not None and runner.leftovers() == [], "the pod runner left things behind"


def node_root(cp: ControlPlane) -> Path:
    assert cp.pods is not None
    node = cp.pods.node(cp.kubelet.node_names[0])
    assert node is not None
    return node.root


def create_pod(cp: ControlPlane, pod: dict[str, Any]) -> dict[str, Any]:
    pod = {"apiVersion": "v1", "kind": "Pod", **pod}
    pod["spec"].setdefault("nodeName", cp.kubelet.node_names[0])
    pod["spec"].setdefault("terminationGracePeriodSeconds", 5)
    resp = cp.http.post(f"/api/v1/namespaces/{NS}/pods", json=pod)
    assert resp.status_code == 201, resp.text
    return resp.json()


def get_pod(cp: ControlPlane, name: str) -> dict[str, Any] | None:
    resp = cp.http.get(f"/api/v1/namespaces/{NS}/pods/{name}")
    return resp.json() if resp.status_code == 200 else None


def ready(pod: dict[str, Any] | None) -> bool:
    conditions = (pod or {}).get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def container_status(pod: dict[str, Any] | None) -> dict[str, Any]:
    statuses = (pod or {}).get("status", {}).get("containerStatuses") or [{}]
    return statuses[0]


def delete_and_wait(cp: ControlPlane, name: str) -> None:
    cp.kubectl("delete", "pod", "-n", NS, name, "--wait=true", timeout=120)
    cp.wait_for(lambda: get_pod(cp, name) is None, timeout_s=60, what=f"pod {name} gone")


PROBE_SCRIPT = textwrap.dedent(
    """
    import json, os, ssl, http.client, http.server, pathlib
    sa = pathlib.Path("/var/run/secrets/kubernetes.io/serviceaccount")
    ctx = ssl.create_default_context(cafile=str(sa / "ca.crt"))
    conn = http.client.HTTPSConnection(
        os.environ["KUBERNETES_SERVICE_HOST"], int(os.environ["KUBERNETES_SERVICE_PORT"]), context=ctx
    )
    review = {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}
    headers = {"Authorization": "Bearer " + (sa / "token").read_text(), "Content-Type": "application/json"}
    conn.request("POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews", json.dumps(review), headers)
    whoami = json.loads(conn.getresponse().read())["status"]["userInfo"]
    out = {
        "env": {k: os.environ.get(k) for k in os.environ["WANTED"].split()},
        "uid": os.getuid(), "gid": os.getgid(), "groups": sorted(os.getgroups()),
        "cwd": os.getcwd(), "hostname": os.uname().nodename,
        "configmap": pathlib.Path("/etc/cm/greeting").read_text(),
        "secret": pathlib.Path("/etc/secret/password").read_text(),
        "namespace_file": (sa / "namespace").read_text(),
        "whoami": whoami,
        "scratch_writable": os.access("/scratch", os.W_OK),
    }
    pathlib.Path("/out/result.json").write_text(json.dumps(out))
    pathlib.Path("/scratch/index.html").write_text("served from the pod")
    os.symlink("/etc/cm/greeting", "/scratch/greeting")  # the ConfigMap's file as the container sees it
    os.chdir("/scratch")
    http.server.test(HandlerClass=http.server.SimpleHTTPRequestHandler, port=8080, bind="0.0.0.0")
    """
)


def test_pod_runs_with_its_volumes_env_identity_and_network(cluster: ControlPlane) -> None:
    cp = cluster
    out_dir = node_root(cp) / "srv" / "out"
    cp.kubectl("create", "configmap", "-n", NS, "settings", "--from-literal=greeting=hello")
    cp.kubectl("create", "secret", "generic", "-n", NS, "creds", "--from-literal=password=s3cret")
    create_pod(
        cp,
        {
            "metadata": {"name": "everything"},
            "spec": {
                "securityContext": {"runAsUser": 1000, "runAsGroup": 1000, "supplementalGroups": [5555]},
                "containers": [
                    {
                        "name": "main",
                        "image": "example.com/keepwarm:test",
                        "command": ["python", "-c", PROBE_SCRIPT],
                        "workingDir": "/etc",
                        "env": [
                            {"name": "WANTED", "value": "NODE POD_IP POD_NS GREETING PASSWORD COMBINED"},
                            {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                            {
                                "name": "POD_NS",
                                "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
                            },
                            {
                                "name": "GREETING",
                                "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "greeting"}},
                            },
                            {
                                "name": "PASSWORD",
                                "valueFrom": {"secretKeyRef": {"name": "creds", "key": "password"}},
                            },
                            {"name": "COMBINED", "value": "$(GREETING)-$(NODE)"},
                        ],
                        "ports": [{"name": "http", "containerPort": 8080}],
                        "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1},
                        "volumeMounts": [
                            {"name": "out", "mountPath": "/out"},
                            {"name": "scratch", "mountPath": "/scratch"},
                            {"name": "cm", "mountPath": "/etc/cm", "readOnly": True},
                            {"name": "secret", "mountPath": "/etc/secret", "readOnly": True},
                        ],
                        "securityContext": {
                            "allowPrivilegeEscalation": False,
                            "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]},
                        },
                    }
                ],
                "volumes": [
                    {"name": "out", "hostPath": {"path": "/srv/out", "type": "DirectoryOrCreate"}},
                    {"name": "scratch", "emptyDir": {}},
                    {"name": "cm", "configMap": {"name": "settings"}},
                    {"name": "secret", "secret": {"secretName": "creds"}},
                ],
            },
        },
    )
    # The hostPath directory exists once the sandbox is up; the container (uid 1000) must write to it.
    cp.wait_for(lambda: out_dir.is_dir(), timeout_s=60, what="the hostPath directory")
    out_dir.chmod(0o777)
    live = cp.wait_for(lambda: ready(p := get_pod(cp, "everything")) and p, timeout_s=120, what="pod Ready")
    result = json.loads((out_dir / "result.json").read_text())
    node = cp.kubelet.node_names[0]
    ip = live["status"]["podIP"]
    assert result["env"] == {
        "NODE": node, "POD_IP": ip, "POD_NS": NS, "GREETING": "hello", "PASSWORD": "s3cret",
        "COMBINED": f"hello-{node}",
    }  # fmt: skip
    assert (result["uid"], result["gid"], result["groups"]) == (1000, 1000, [1000, 5555])
    assert (result["cwd"], result["hostname"]) == ("/etc", "everything")
    assert (result["configmap"], result["secret"], result["namespace_file"]) == ("hello", "s3cret", NS)
    assert result["whoami"]["username"] == f"system:serviceaccount:{NS}:default"
    assert result["whoami"]["extra"]["authentication.kubernetes.io/pod-name"] == ["everything"]
    assert result["scratch_writable"]
    node_obj = cp.http.get(f"/api/v1/nodes/{node}").json()
    prefix = node_obj["spec"]["podCIDR"].rsplit(".", 1)[0] + "."
    assert ip.startswith(prefix)
    assert httpx.get(f"http://{ip}:8080/index.html", timeout=10).text == "served from the pod"
    status = container_status(live)
    assert status["image"] == "example.com/keepwarm:test" and status["restartCount"] == 0
    # A changed ConfigMap reaches the running container's mounted file, as a kubelet's sync does.
    assert httpx.get(f"http://{ip}:8080/greeting", timeout=10).text == "hello"
    cp.kubectl(
        "patch", "configmap", "settings", "-n", NS, "--type=merge", "-p", '{"data": {"greeting": "bonjour"}}'
    )
    cp.wait_for(
        lambda: httpx.get(f"http://{ip}:8080/greeting", timeout=10).text == "bonjour",
        timeout_s=60,
        what="the updated ConfigMap in the pod",
    )
    assert container_status(get_pod(cp, "everything"))["restartCount"] == 0
    delete_and_wait(cp, "everything")


def test_crash_restarts_with_backoff_and_liveness_kills(cluster: ControlPlane) -> None:
    cp = cluster
    create_pod(
        cp,
        {
            "metadata": {"name": "crasher"},
            "spec": {
                "containers": [{"name": "c", "image": "x", "command": ["sh", "-c", "sleep 0.5; exit 3"]}]
            },
        },
    )
    create_pod(
        cp,
        {
            "metadata": {"name": "unhealthy"},
            "spec": {
                "terminationGracePeriodSeconds": 1,
                "containers": [
                    {
                        "name": "c",
                        "image": "x",
                        # Healthy for 2 s, then the liveness file goes and the probe fails.
                        "command": ["sh", "-c", "touch /tmp/alive; sleep 2; rm /tmp/alive; sleep 600"],
                        "livenessProbe": {
                            "exec": {"command": ["test", "-e", "/tmp/alive"]},
                            "periodSeconds": 1,
                            "failureThreshold": 2,
                        },
                    }
                ],
            },
        },
    )

    def crash_looping() -> dict[str, Any] | None:
        status = container_status(get_pod(cp, "crasher"))
        waiting = status.get("state", {}).get("waiting", {})
        return (
            status
            if status.get("restartCount", 0) >= 2 and waiting.get("reason") == "CrashLoopBackOff"
            else None
        )

    status = cp.wait_for(crash_looping, timeout_s=120, what="crasher in CrashLoopBackOff after two restarts")
    assert status["lastState"]["terminated"]["exitCode"] == 3
    assert status["lastState"]["terminated"]["reason"] == "Error"
    assert not ready(get_pod(cp, "crasher"))

    restarted = cp.wait_for(
        lambda: (s := container_status(get_pod(cp, "unhealthy"))).get("restartCount", 0) >= 1 and s,
        timeout_s=120,
        what="unhealthy restarted by its liveness probe",
    )
    # sh as PID 1 ignores SIGTERM: SIGKILL after the 1 s grace period.
    assert restarted["lastState"]["terminated"]["exitCode"] == 137
    for name in ("crasher", "unhealthy"):
        delete_and_wait(cp, name)


def test_deletion_sends_sigterm_and_leaves_nothing(cluster: ControlPlane) -> None:
    cp = cluster
    script = 'trap "echo term > /out/term; exit 0" TERM; touch /out/up; while :; do sleep 0.1; done'
    created = create_pod(
        cp,
        {
            "metadata": {"name": "graceful"},
            "spec": {
                "containers": [
                    {
                        "name": "c",
                        "image": "x",
                        "command": ["sh", "-c", script],
                        "volumeMounts": [{"name": "out", "mountPath": "/out"}],
                        "resources": {"limits": {"memory": "64Mi", "cpu": "250m"}},
                    }
                ],
                "volumes": [
                    {"name": "out", "hostPath": {"path": "/srv/graceful", "type": "DirectoryOrCreate"}}
                ],
            },
        },
    )
    uid = created["metadata"]["uid"]
    assert cp.pods is not None
    cgroup = cp.pods.cgroup_for(uid)
    cp.wait_for(lambda: ready(get_pod(cp, "graceful")), timeout_s=120, what="pod Ready")
    out = node_root(cp) / "srv" / "graceful"
    cp.wait_for(lambda: (out / "up").exists(), timeout_s=60, what="the container's TERM trap in place")
    memory_limit = cgroup.paths()[0] / "memory.limit_in_bytes"
    assert int(memory_limit.read_text()) == 64 << 20
    assert cgroup.pids()
    delete_and_wait(cp, "graceful")
    assert (out / "term").read_text().strip() == "term"
    assert not any(p.exists() for p in cgroup.paths())
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"kwt-{uid}" not in netns
    assert not (cp.pods.root / "pods" / uid).exists()


def test_missing_hostpath_of_checked_type_is_reported(cluster: ControlPlane) -> None:
    cp = cluster
    create_pod(
        cp,
        {
            "metadata": {"name": "no-model"},
            "spec": {
                "containers": [{"name": "c", "image": "x", "command": ["sleep", "600"]}],
                "volumes": [{"name": "m", "hostPath": {"path": "/models/absent", "type": "Directory"}}],
            },
        },
    )

    def reported() -> str | None:
        waiting = container_status(get_pod(cp, "no-model")).get("state", {}).get("waiting", {})
        return waiting.get("message") if waiting.get("reason") == "ContainerCreating" else None

    message = cp.wait_for(lambda: reported() and "does not exist" in reported() and reported(), timeout_s=60)
    assert "/models/absent" in message
    delete_and_wait(cp, "no-model")
