"""Pod status as a kubelet reports it, from the runner's view of each container (pure functions)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

POD_CONDITIONS = ("PodReadyToStartContainers", "Initialized", "Ready", "ContainersReady", "PodScheduled")


def timestamp() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class ContainerView:
    """What the status needs of one container."""

    name: str
    image: str
    container_id: str = ""  # kwt://<shim pid> of the current (or last) process
    state: dict[str, Any] = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: dict[str, Any] = field(default_factory=dict)
    restart_count: int = 0
    ready: bool = False
    started: bool = False

    def wire(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "image": self.image,
            "imageID": f"kwt://{self.image}",
            "containerID": self.container_id,
            "ready": self.ready,
            "started": self.started,
            "restartCount": self.restart_count,
            "state": self.state,
            "lastState": self.last_state,
        }


def terminated(
    exit_code: int, started_at: str, container_id: str, reason: str | None = None
) -> dict[str, Any]:
    return {
        "terminated": {
            "exitCode": exit_code,
            "reason": reason or ("Completed" if exit_code == 0 else "Error"),
            "startedAt": started_at,
            "finishedAt": timestamp(),
            "containerID": container_id,
        }
    }


def pod_status(
    *,
    old: dict[str, Any],
    sandbox_ready: bool,
    initialized: bool,
    inits: list[ContainerView],
    containers: list[ContainerView],
    pod_ip: str | None,
    host_ip: str,
    phase: str | None = None,
    message: str | None = None,
) -> dict[str, Any]:
    """The status to PATCH; lastTransitionTime only moves when a condition's status changes."""
    ready = initialized and all(c.ready for c in containers)
    verdicts = {
        "PodScheduled": True,
        "PodReadyToStartContainers": sandbox_ready,
        "Initialized": initialized,
        "ContainersReady": ready,
        "Ready": ready,
    }
    previous = {c["type"]: c for c in old.get("conditions", [])}
    conditions = []
    for kind in POD_CONDITIONS:
        value = "True" if verdicts[kind] else "False"
        before = previous.get(kind, {})
        since = before.get("lastTransitionTime") if before.get("status") == value else None
        conditions.append({"type": kind, "status": value, "lastTransitionTime": since or timestamp()})
    running = any("running" in c.state for c in containers) or any(c.restart_count for c in containers)
    status: dict[str, Any] = {
        "phase": phase or ("Running" if initialized and running else "Pending"),
        "conditions": conditions,
        "containerStatuses": [c.wire() for c in containers],
        "startTime": old.get("startTime") or timestamp(),
        "hostIP": host_ip,
        "hostIPs": [{"ip": host_ip}],
    }
    if inits:
        status["initContainerStatuses"] = [c.wire() for c in inits]
    if pod_ip:
        status["podIP"] = pod_ip
        status["podIPs"] = [{"ip": pod_ip}]
    if message:
        status["message"] = message
    return status


def without_times(value: Any) -> Any:
    """The status with every timestamp blanked: equal results mean nothing worth a PATCH changed."""
    if isinstance(value, dict):
        return {k: without_times(v) for k, v in value.items() if not k.endswith(("Time", "At"))}
    if isinstance(value, list):
        return [without_times(v) for v in value]
    return value
