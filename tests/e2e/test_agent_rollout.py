"""The node stays warm through the cache agent's own upgrade and crash, on real pods.

One control plane with a real node (root only, tests/e2e/conftest.py): the chart's operator pod, a host-
tier WeightCache whose agent DaemonSet pod keeps the model Resident, one runtime pod attached to it and
answering through the official `openai` client. Then an upgrade as a user makes one: a new agent image
tag in the WeightCache (the same build, pushed under a second tag), so a new DaemonSet pod template.
Throughout the rollout a watch sees every write of the WeightCacheNode, a poller which agent pods run,
and a client asks the runtime pod over and over. Then a SIGKILL of the agent container's daemon, and a
client asking throughout again. The steps share state and run in order.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from keepwarm_testing.e2e import (
    RUNTIME_IMAGE,
    agent_metrics,
    agent_selector,
    answer,
    apply,
    cpu_inference_deployment,
    host_weightcache,
    install_chart,
    is_ready,
    is_resident,
    lists_resident,
    metric,
    pods,
    ready_pods,
    resident_node,
    runtime_selector,
    sample_sum,
)
from keepwarm_testing.operator import GROUP_PATH, NAMESPACE, get
from tests.running_pods import ON_REAL_NODES

pytestmark = ON_REAL_NODES
WC, IDEP, APPS = "rollout", "chat", "rollout-apps"
AGENTS, RUNTIME = agent_selector(WC), runtime_selector(IDEP)
NEW_IMAGE = RUNTIME_IMAGE.rsplit(":", 1)[0] + ":rollout-test"  # the same build under a second tag
POLL_S = 0.25


@pytest.fixture(scope="module")
def rollout(e2e_cluster: SimpleNamespace) -> SimpleNamespace:
    return e2e_cluster


@dataclass
class Watch:
    """A background loop calling `probe` every POLL_S until stopped, keeping what it returns."""

    probe: Callable[[], Any]
    seen: list[Any] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> Watch:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join(timeout=180)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.seen.append(self.probe())
            except Exception as exc:  # every failure is a finding, kept for the assert
                self.errors.append(f"{type(exc).__name__}: {exc}")
            self.stop.wait(POLL_S)


class NodeWatch:
    """The cache's WeightCacheNode as listed at the start, then every write of it until stopped, as
    a watch delivers them: no status the agents write escapes, however briefly it stands."""

    def __init__(self, cp: Any) -> None:
        self.cp, self.path = cp, f"{GROUP_PATH}/weightcachenodes?labelSelector=keepwarm.dev/weightcache={WC}"
        self.seen: list[tuple[str, dict[str, Any]]] = []  # (event type, the object as it was)
        self.errors: list[str] = []
        self.stop = threading.Event()

    def __enter__(self) -> NodeWatch:
        listing = get(self.cp, self.path) or {}
        self.seen += [("LISTED", obj) for obj in listing["items"]]
        self.version = listing["metadata"]["resourceVersion"]
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join(timeout=60)

    def _run(self) -> None:
        with self.cp.http_client(httpx.Timeout(30, read=None)) as http:
            while not self.stop.is_set():  # short watches, each from the last version seen
                query = f"&watch=1&timeoutSeconds=2&resourceVersion={self.version}"
                try:
                    with http.stream("GET", self.path + query) as resp:
                        resp.raise_for_status()
                        for line in resp.iter_lines():
                            self._event(json.loads(line))
                except Exception as exc:  # every failure is a finding, kept for the assert
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                    self.stop.wait(POLL_S)

    def _event(self, event: dict[str, Any]) -> None:
        obj = event["object"]
        if event["type"] == "ERROR":  # e.g. 410 Gone: the versions between are lost, say so
            raise RuntimeError(f"watch error: {obj}")
        self.version = obj["metadata"]["resourceVersion"]
        self.seen.append((event["type"], obj))

    def cold(self, *, ready: bool = True) -> list[dict[str, Any]]:
        """The statuses seen without the model Resident (with `ready`: or the node not Ready)."""
        return [
            obj.get("status") or {}
            for kind, obj in self.seen
            if kind == "DELETED" or not (is_resident(obj) if ready else lists_resident(obj))
        ]


def running_agents(cp: Any) -> frozenset[str]:
    """The uids of agent pods whose agent container runs now."""
    running = set()
    for pod in pods(cp, NAMESPACE, AGENTS):
        statuses = pod.get("status", {}).get("containerStatuses", [])
        if any(s["name"] == "agent" and "running" in s.get("state", {}) for s in statuses):
            running.add(pod["metadata"]["uid"])
    return frozenset(running)


def the_runtime_pod(cp: Any) -> dict[str, Any]:
    (pod,) = ready_pods(cp, APPS, RUNTIME, 1) or [None]
    assert pod is not None
    return pod


def test_agent_keeps_the_model_resident_and_a_runtime_pod_answers(rollout: SimpleNamespace) -> None:
    cp = rollout.cp
    install_chart(cp)
    apply(cp, host_weightcache(WC))
    cp.wait_for(lambda: resident_node(cp, WC), timeout_s=240, what="the model Resident on the node")
    (rollout.agent,) = cp.wait_for(lambda: ready_pods(cp, NAMESPACE, AGENTS, 1), timeout_s=120, what="agent")
    cp.kubectl("create", "namespace", APPS)
    apply(cp, cpu_inference_deployment(IDEP, APPS, WC, replicas=1))
    (pod,) = cp.wait_for(lambda: ready_pods(cp, APPS, RUNTIME, 1), timeout_s=300, what="a runtime pod Ready")
    rollout.answer = answer(pod)
    assert rollout.answer
    assert set(metric(pod, "keepwarm_weight_load_seconds")) == {"cache"}


def test_agent_rollout_hands_off_and_keeps_the_node_warm(rollout: SimpleNamespace) -> None:
    """A new agent image: the DaemonSet surges a second pod onto the node, whose agent takes the
    arenas over from the old one; the old pod then goes. The node never shows the model cold, and
    the runtime pod never fails a request."""
    cp, old = rollout.cp, rollout.agent
    runtime = the_runtime_pod(cp)
    assert cp.nodes is not None and cp.nodes.images is not None
    cp.nodes.publish(cp.nodes.images.runtime, NEW_IMAGE)

    def ask() -> bool:
        return answer(runtime) == rollout.answer

    with (
        NodeWatch(cp) as node,
        Watch(lambda: running_agents(cp)) as agents,
        Watch(ask) as asks,
    ):
        cp.kubectl(
            "patch",
            "weightcache",
            WC,
            "--type=merge",
            "-p",
            f'{{"spec":{{"agent":{{"image":"{NEW_IMAGE}"}}}}}}',
        )

        def rolled() -> dict[str, Any] | None:
            now = pods(cp, NAMESPACE, AGENTS)
            new = [p for p in now if p["spec"]["containers"][0]["image"] == NEW_IMAGE and is_ready(p)]
            return new[0] if len(now) == 1 and new else None

        new = cp.wait_for(rolled, timeout_s=300, what="the new agent pod Ready and the old one gone")
        cp.wait_for(lambda: resident_node(cp, WC), timeout_s=60, what="the node Resident after the rollout")
        time.sleep(2 * POLL_S)  # one more look by every watcher after the end
    assert get(cp, f"/api/v1/namespaces/{NAMESPACE}/pods/{old['metadata']['name']}") is None
    assert node.seen and not node.errors, node.errors
    assert not node.cold(), f"the WeightCacheNode showed the model not Resident: {node.cold()[0]}"
    overlap = [uids for uids in agents.seen if uids >= {old["metadata"]["uid"], new["metadata"]["uid"]}]
    assert overlap, f"old and new agent never ran side by side: {sorted(set(agents.seen), key=len)}"
    assert asks.seen and all(asks.seen) and not asks.errors, (asks.errors[:3], asks.seen.count(False))
    text = agent_metrics(new)
    assert sample_sum(text, "keepwarm_cache_handoffs_total", role="successor", outcome="committed") == 1
    assert sample_sum(text, "keepwarm_cache_adopted_arenas_total", source="predecessor") == 1
    assert sample_sum(text, "keepwarm_cache_start_arenas", source="disk") == 0
    rollout.agent = new


def test_runtime_pod_started_after_the_rollout_attaches_from_the_cache(rollout: SimpleNamespace) -> None:
    cp = rollout.cp
    before = the_runtime_pod(cp)
    cp.kubectl("scale", "-n", APPS, f"inferencedeployment/{IDEP}", "--replicas=2")
    ready = cp.wait_for(lambda: ready_pods(cp, APPS, RUNTIME, 2), timeout_s=300, what="a second runtime pod")
    (fresh,) = [p for p in ready if p["metadata"]["uid"] != before["metadata"]["uid"]]
    assert answer(fresh) == rollout.answer
    assert set(metric(fresh, "keepwarm_weight_load_seconds")) == {"cache"}  # no disk fallback
    cp.kubectl("scale", "-n", APPS, f"inferencedeployment/{IDEP}", "--replicas=1")
    cp.wait_for(lambda: len(pods(cp, APPS, RUNTIME)) == 1, timeout_s=120, what="one runtime pod again")


def test_killed_agent_restarts_warm_through_the_holder(rollout: SimpleNamespace) -> None:
    """SIGKILL of the agent container's daemon: the kubelet restarts the container, whose daemon
    takes the arenas back from the holder container; every write of the WeightCacheNode lists the
    model Resident, and the runtime pod keeps serving meanwhile."""
    cp, agent = rollout.cp, rollout.agent
    runtime = the_runtime_pod(cp)
    assert cp.nodes is not None
    daemon = cp.nodes.container_pid(
        get(cp, f"/api/v1/namespaces/{NAMESPACE}/pods/{agent['metadata']['name']}"), "agent"
    )

    def restarted() -> dict[str, Any] | None:
        now = get(cp, f"/api/v1/namespaces/{NAMESPACE}/pods/{agent['metadata']['name']}")
        status = next(
            s for s in (now or {}).get("status", {}).get("containerStatuses", []) if s["name"] == "agent"
        )
        return now if status.get("restartCount") == 1 and is_ready(now) else None

    with NodeWatch(cp) as node, Watch(lambda: answer(runtime) == rollout.answer) as asks:
        os.kill(daemon, signal.SIGKILL)
        again = cp.wait_for(restarted, timeout_s=300, what="the killed agent container restarted and Ready")
        cp.wait_for(lambda: resident_node(cp, WC), timeout_s=120, what="the model Resident again")
        time.sleep(2 * POLL_S)
    # The operator may call the node Stale meanwhile (no heartbeat for a while on a loaded box): that
    # is true; listing the model as anything but Resident would not be.
    assert node.seen and not node.errors, node.errors
    assert not node.cold(ready=False), (
        f"the WeightCacheNode listed the model not Resident: {node.cold(ready=False)[0]}"
    )
    assert asks.seen and all(asks.seen) and not asks.errors, (asks.errors[:3], asks.seen.count(False))
    statuses = {s["name"]: s for s in again["status"]["containerStatuses"]}
    assert statuses["agent"]["lastState"]["terminated"]["exitCode"] == 137
    assert statuses["holder"]["restartCount"] == 0
    text = agent_metrics(again)
    assert sample_sum(text, "keepwarm_cache_adopted_arenas_total", source="holder") == 1
    assert sample_sum(text, "keepwarm_cache_start_arenas", source="disk") == 0
    (fresh,) = pods(cp, APPS, RUNTIME)
    assert fresh["metadata"]["uid"] == runtime["metadata"]["uid"] and answer(fresh) == rollout.answer
