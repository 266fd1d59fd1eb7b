"""One probe attempt (httpGet, tcpSocket, exec) and the kubelet's bookkeeping around attempts.

httpGet and tcpSocket go from the host to the pod IP (as a kubelet's do), a named port resolves
through the container's `ports`; exec runs in the container's namespaces as its user (nsenter).
Success: HTTP 200..399, a TCP connect, exit status 0. grpc probes are refused by name.
`ProbeState` applies initialDelaySeconds, periodSeconds, successThreshold and failureThreshold with
the kubelet's defaults (0, 10, 1, 3; timeoutSeconds 1).
"""

from __future__ import annotations

import socket
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


class ProbeConfigError(ValueError):
    """The probe cannot run as written (unknown named port, unsupported handler)."""


def resolve_port(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports", []):
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ProbeConfigError(
        f"container {container['name']}: probe names port {port!r}, which it does not declare"
    )


def attempt(
    probe: dict[str, Any], container: dict[str, Any], pod_ip: str, pid1: int | None, uid: int, gid: int
) -> bool:
    """One try; a timeout or refused connection is a failure, never an exception."""
    timeout = float(probe.get("timeoutSeconds", 1))
    try:
        if "httpGet" in probe:
            get = probe["httpGet"]
            scheme = get.get("scheme", "HTTP").lower()
            port = resolve_port(container, get["port"])
            url = f"{scheme}://{get.get('host') or pod_ip}:{port}{get.get('path', '/')}"
            headers = {h["name"]: h["value"] for h in get.get("httpHeaders", [])}
            resp = httpx.get(url, headers=headers, timeout=timeout, verify=False)
            return 200 <= resp.status_code < 400
        if "tcpSocket" in probe:
            port = resolve_port(container, probe["tcpSocket"]["port"])
            with socket.create_connection((probe["tcpSocket"].get("host") or pod_ip, port), timeout=timeout):
                return True
        if "exec" in probe:
            if pid1 is None:
                return False
            cmd = ["nsenter", "-t", str(pid1), "-m", "-u", "-i", "-n", "-p", "-S", str(uid), "-G", str(gid)]
            proc = subprocess.run(
                [*cmd, "--", *probe["exec"]["command"]], capture_output=True, timeout=timeout
            )
            return proc.returncode == 0
    except (httpx.HTTPError, OSError, subprocess.TimeoutExpired):
        return False
    raise ProbeConfigError(f"container {container['name']}: probe handler {sorted(probe)} is not supported")


@dataclass
class ProbeState:
    """When the next attempt is due and what the attempts so far add up to."""

    probe: dict[str, Any]
    started_at: float  # monotonic time the container started
    successes: int = 0
    failures: int = 0
    passed: bool = False  # the current verdict (successThreshold reached, and not failed since)
    next_at: float = field(default=0.0)

    def __post_init__(self) -> None:
        self.next_at = self.started_at + float(self.probe.get("initialDelaySeconds", 0))

    @property
    def period_s(self) -> float:
        return float(self.probe.get("periodSeconds", 10))

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def record(self, ok: bool, now: float) -> None:
        self.next_at = now + self.period_s
        if ok:
            self.successes, self.failures = self.successes + 1, 0
            if self.successes >= int(self.probe.get("successThreshold", 1)):
                self.passed = True
        else:
            self.failures, self.successes = self.failures + 1, 0
            if self.failures >= int(self.probe.get("failureThreshold", 3)):
                self.passed = False

    @property
    def failed(self) -> bool:
        """failureThreshold consecutive failures."""
        return self.failures >= int(self.probe.get("failureThreshold", 3))


def now() -> float:
    return time.monotonic()
