"""A node takes one snapshot for pods that start together, and later pods restore it: they serve the
same tokens as an importing pod, differ in every random state, report their start, and stop as a
kubelet stops them."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from keepwarm_runtime.snapshot.store import Store
from tests.integration.snapshot.conftest import Node, Pod, start_pod, startup_source

pytestmark = pytest.mark.extended  # the snapshot's integration tests: `make test-extended`


def _first_two_pods(node: Node, criu: Path, model: Path, logs: Path) -> list[Pod]:
    return [start_pod(model, logs / f"first-{i}.log", node.store, criu, node.socket_dir) for i in range(2)]


@pytest.fixture(scope="module")
def first_pods(
    node: Node, criu: Path, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[Pod]]:
    """Two pods started together on an empty store: both import, and the node takes one snapshot."""
    pods = _first_two_pods(node, criu, tiny_llama, tmp_path_factory.mktemp("first"))
    try:
        for pod in pods:
            pod.server.wait(timeout=600)
        node.wait_for(r"snapshots: (took|no snapshot of)")
        yield pods
    finally:
        for pod in pods:
            pod.stop()


def test_pods_that_start_together_import_and_the_node_takes_one_snapshot(
    node: Node, first_pods: list[Pod]
) -> None:
    assert [startup_source(pod.server) for pod in first_pods] == [("imports", "absent")] * 2
    assert len(node.wait_for(r"snapshots: took ")) == 1
    assert len(node.snapshots()) == 1
    answers = " ".join(pod.server.log_text() for pod in first_pods)
    assert "asked the node agent for snapshot" in answers and ": started" in answers
    assert not list(node.store.glob(".tmp-*"))  # nothing of the take is left beside it


def test_a_restored_pod_serves_the_same_tokens_and_reports_its_start(
    node: Node, criu: Path, first_pods: list[Pod], pods
) -> None:
    pod = pods(node.store, criu, node.socket_dir)
    pod.server.wait(timeout=300)
    assert startup_source(pod.server) == ("snapshot", "hit")
    metrics = pod.server.metrics()
    assert metrics['keepwarm_startup_phase_seconds{phase="restore"}'] > 0
    request = {"model": "tiny", "prompt": "the restored parent", "max_tokens": 8, "temperature": 0}
    restored = _complete(pod.server, request)
    imported = _complete(first_pods[0].server, request)
    assert restored == imported and restored
    assert "snapshots: restored " in pod.server.log_text()
    assert "API socket: the launcher's" in pod.server.log_text()  # bound at the pod's start, handed over
    assert sum(e.usage.restores for e in Store(node.store).entries()) >= 1  # the node counted it


def test_two_restored_pods_differ_in_every_random_state(
    node: Node, criu: Path, first_pods: list[Pod], pods
) -> None:
    both = [pods(node.store, criu, node.socket_dir) for _ in range(2)]
    digests = []
    for pod in both:
        pod.server.wait(timeout=300)
        assert startup_source(pod.server) == ("snapshot", "hit")
        line = re.search(r"random state digests: (.*)", pod.server.log_text())
        assert line is not None, pod.server.log_tail()
        digests.append(dict(item.split("=") for item in line.group(1).split()))
    assert set(digests[0]) == {"random", "tempfile", "authkey", "numpy", "torch"}
    assert all(digests[0][name] != digests[1][name] for name in digests[0]), digests


def test_the_launcher_forwards_sigterm_and_exits_with_the_parents_code(
    node: Node, criu: Path, first_pods: list[Pod], pods
) -> None:
    pod = pods(node.store, criu, node.socket_dir)
    pod.server.wait(timeout=300)
    assert startup_source(pod.server) == ("snapshot", "hit")
    assert pod.stop() == 0  # the kubelet's SIGTERM to PID 1, forwarded: the worker drained, all ended
    log = pod.server.log_text()
    assert "stopping worker" in log and "Finished server process" in log


def _complete(server, request: dict) -> str:
    import json
    import urllib.request

    req = urllib.request.Request(
        server.url + "/v1/completions",
        data=json.dumps(request).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as response:
        return json.loads(response.read())["choices"][0]["text"]


def test_a_restored_parent_that_dies_unasked_is_replaced_by_importing_in_the_same_pod(
    node: Node, criu: Path, first_pods: list[Pod], pods
) -> None:
    import os
    import signal
    import time

    pod = pods(node.store, criu, node.socket_dir)
    pod.server.wait(timeout=300)
    assert startup_source(pod.server) == ("snapshot", "hit")
    launcher = pod.launcher_pid
    [parent] = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    os.kill(int(parent), signal.SIGKILL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # the port answers again once the launcher has imported
        try:
            if pod.server.startup_source() == ("imports", "restored_exited"):
                break
        except (RuntimeError, KeyError):
            pass
        time.sleep(0.5)
    assert pod.server.startup_source() == ("imports", "restored_exited")
    assert pod.server.proc.poll() is None  # the same pod: no container restart
    assert "the restored parent failed unasked (exit 137): importing in its place" in pod.server.log_text()
