"""One container through the pod runner's lowest layers (no control plane): namespaces, root,
volumes, user and capabilities, the pod network and the cgroup, and that nothing is left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from keepwarm_testing.controlplane.pods import cgroups
from keepwarm_testing.controlplane.pods.container import Launch, Mount, Running, effective_capabilities, start
from keepwarm_testing.controlplane.pods.network import PodNetwork, existing
from tests.running_pods import NEEDS_ROOT

pytestmark = NEEDS_ROOT
VENV_BIN = str(Path(os.sys.executable).parent)
PATH = f"{VENV_BIN}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
POD = f"pod-a-{os.getpid()}"  # the pod uid: unique, so runs side by side never share a namespace


@pytest.fixture
def sandbox(tmp_path: Path) -> Iterator[tuple[PodNetwork, cgroups.PodCgroup, str]]:
    """A bridge, one pod network namespace and one pod cgroup; all removed afterwards, even on failure."""
    net = PodNetwork()
    net.setup()
    cgroup = cgroups.PodCgroup(f"kwt-t{os.getpid()}", POD)
    try:
        cgroup.create(cgroups.Limits(memory_bytes=512 << 20, cpu_millis=500))
        address = net.allocate(1)
        net.create_pod_netns(POD, address, "pod-a")
        yield net, cgroup, address
    finally:
        cgroup.remove()
        cgroups.remove_group(cgroup.group)
        net.delete_pod_netns(POD)
        net.teardown()
    assert existing(net.bridge, {POD}) == []


def launch(cgroup: cgroups.PodCgroup, argv: list[str], **kw: object) -> Launch:
    defaults: dict = dict(
        env={"PATH": PATH, "HOME": "/"},
        uid=0,
        gid=0,
        groups=[],
        capabilities=[],
        hostname="pod-a",
        netns=f"/run/netns/kwt-{POD}",
        cgroup_procs=[str(p) for p in cgroup.procs_files()],
    )
    return Launch(argv=argv, **{**defaults, **kw})


def run_to_exit(running: Running, timeout: float = 60) -> str:
    running.proc.wait(timeout)
    return running.log.read_text()


def test_user_groups_caps_hostname_and_read_only_mounts(sandbox, tmp_path: Path) -> None:
    _, cgroup, _ = sandbox
    data = tmp_path / "data"
    data.mkdir()
    (data / "model.txt").write_text("weights\n")
    scratch = tmp_path / "rw"
    scratch.mkdir(mode=0o777)
    scratch.chmod(0o777)
    script = (
        "id -u; id -G; hostname; cat /models/model.txt; "
        "touch /models/x 2>/dev/null && echo models-writable || echo models-ro; "
        "touch /rootfile 2>/dev/null && echo root-writable || echo root-ro; "
        "touch /scratch/ok && echo scratch-writable; "
        "grep CapEff /proc/self/status; echo pid=$$; "
        "test -e /var/run/secrets/kubernetes.io/serviceaccount/model.txt && echo nested-mount; "
        "python -c 'import keepwarm_runtime; print(\"keepwarm-importable\")'"
    )
    running = start(
        launch(
            cgroup,
            ["sh", "-c", script],
            uid=1234,
            gid=2345,
            groups=[44, 3456],
            mounts=[
                Mount(str(data), "/models", read_only=True),
                Mount(str(scratch), "/scratch"),
                Mount(str(data), "/var/run/secrets/kubernetes.io/serviceaccount", read_only=True),
            ],
            read_only_root=True,
            no_new_privs=True,
        ),
        tmp_path / "c1",
    )
    out = run_to_exit(running).split("\n")
    assert running.proc.returncode == 0, out
    assert out[0] == "1234"
    assert set(out[1].split()) == {"2345", "44", "3456"}
    assert out[2] == "pod-a"
    assert out[3:8] == ["weights", "models-ro", "root-ro", "scratch-writable", "CapEff:\t0000000000000000"]
    assert out[8] == "pid=1"  # its own PID namespace
    assert "nested-mount" in out and "keepwarm-importable" in out
    assert not Path("/var/run/secrets/kubernetes.io/serviceaccount").exists()  # no leak onto the host
    assert (scratch / "ok").exists()


def test_root_with_only_added_capabilities(sandbox, tmp_path: Path) -> None:
    _, cgroup, _ = sandbox
    caps = effective_capabilities({"capabilities": {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}})
    assert caps == ["CHOWN", "FOWNER"]
    running = start(
        launch(cgroup, ["sh", "-c", "grep CapEff /proc/self/status"], capabilities=caps), tmp_path / "c"
    )
    assert run_to_exit(running).strip() == "CapEff:\t0000000000000009"  # bits 0 (CHOWN) and 3 (FOWNER)
    defaults = effective_capabilities({})
    assert "NET_RAW" in defaults and "SYS_ADMIN" not in defaults


def test_pod_ip_reachable_from_host(sandbox, tmp_path: Path) -> None:
    _, cgroup, address = sandbox
    www = tmp_path / "www"
    www.mkdir()
    (www / "index.html").write_text("hello from the pod")
    running = start(
        launch(
            cgroup,
            ["python", "-m", "http.server", "8080"],
            working_dir="/www",
            mounts=[Mount(str(www), "/www")],
        ),
        tmp_path / "c",
    )
    deadline = time.monotonic() + 60
    body = None
    while time.monotonic() < deadline and body is None:
        try:
            body = httpx.get(f"http://{address}:8080/index.html", timeout=2).text
        except httpx.HTTPError:
            time.sleep(0.2)
    assert body == "hello from the pod"
    pid1 = running.pid1()
    assert pid1 is not None and pid1 in cgroup.pids()
    running.signal(signal.SIGKILL)
    running.proc.wait(30)
    assert running.proc.returncode == 128 + signal.SIGKILL
    assert cgroup.pids() == set()


def test_sigterm_reaches_pid1_handler(sandbox, tmp_path: Path) -> None:
    _, cgroup, _ = sandbox
    script = 'trap "echo got-term; exit 7" TERM; echo up; while :; do sleep 0.1; done'
    running = start(launch(cgroup, ["sh", "-c", script]), tmp_path / "c")
    deadline = time.monotonic() + 30
    while "up" not in running.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    running.signal(signal.SIGTERM)
    assert "got-term" in run_to_exit(running, timeout=30)
    assert running.proc.returncode == 7


def test_memory_limit_and_kill_all_reaches_daemons(sandbox, tmp_path: Path) -> None:
    _, cgroup, _ = sandbox
    limit = (cgroup.paths()[0] / "memory.limit_in_bytes").read_text().strip()
    assert int(limit) == 512 << 20
    # A grandchild that leaves its session still sits in the pod's cgroup, so kill_all finds it.
    running = start(launch(cgroup, ["sh", "-c", "setsid sleep 300 & sleep 300"]), tmp_path / "c")
    deadline = time.monotonic() + 30
    while len(cgroup.pids()) < 4 and time.monotonic() < deadline:  # shim, sh, two sleeps
        time.sleep(0.1)
    assert len(cgroup.pids()) >= 4
    cgroup.kill_all()
    running.proc.wait(10)
    assert cgroup.pids() == set()


def test_setup_failure_is_reported_in_the_log(sandbox, tmp_path: Path) -> None:
    _, cgroup, _ = sandbox
    running = start(launch(cgroup, ["no-such-binary-kwt"]), tmp_path / "c")
    log = run_to_exit(running)
    assert running.proc.returncode != 0
    assert "no-such-binary-kwt" in log
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"kwt-{POD}" in out  # the sandbox outlives its containers; the fixture removes it
