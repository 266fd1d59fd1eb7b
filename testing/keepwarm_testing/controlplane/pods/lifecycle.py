"""Container lifecycle hooks as the kubelet runs them: preStop before SIGTERM, within the grace period.

    lifecycle.check(container)               # at container start: an unsupported hook is refused by name
    lifecycle.pre_stop(container, target, s, cancel)  # at deletion: its preStop, for up to s seconds

preStop handlers: `exec` (in the container's namespaces as its user, as an exec probe), `httpGet`
(from the host to the pod IP, a named port resolved through the container's ports), `sleep` (the
kubelet itself waits; nothing runs in the container). The hook may take the whole grace period; the
kubelet then sends SIGTERM and keeps whatever is left of the period for it, at least
MIN_GRACE_AFTER_HOOK_S (its one-off extension for a hook that overran). A failed hook is logged and
the pod stops anyway. Hooks run on pod deletion only: a container killed for a failed liveness or
startup probe gets SIGTERM at once here (the kubelet would run its preStop first). postStart, the
deprecated tcpSocket handler and anything else are refused when the container would start
(CreateContainerConfigError), never skipped in silence.
"""

from __future__ import annotations

import logging
import subprocess
import threading
from dataclasses import dataclass
from typing import Any

import httpx

from .env import ConfigError
from .probes import ProbeConfigError, resolve_port

log = logging.getLogger("keepwarm.test.pods")
HANDLERS = ("exec", "httpGet", "sleep")  # of a preStop hook
MIN_GRACE_AFTER_HOOK_S = 2.0  # the kubelet's minimum between SIGTERM and SIGKILL after a preStop


@dataclass(frozen=True)
class HookTarget:
    """Where a hook reaches its container: the pod IP (httpGet) and PID 1, user and group (exec)."""

    ip: str
    pid1: int | None
    uid: int
    gid: int


def check(container: dict[str, Any]) -> None:
    """Raise ConfigError when the container asks for a hook this runner does not run."""
    hooks = container.get("lifecycle") or {}
    name = container["name"]
    for hook in sorted(set(hooks) - {"preStop"}):
        raise ConfigError(f"container {name}: lifecycle.{hook} is not supported by the pod runner")
    handler = hooks.get("preStop")
    if handler is None:
        return
    kinds = sorted(k for k in handler if handler[k] is not None)
    if len(kinds) != 1 or kinds[0] not in HANDLERS:
        raise ConfigError(
            f"container {name}: lifecycle.preStop handler {kinds} is not supported (one of {list(HANDLERS)})"
        )
    if "httpGet" in handler:
        try:
            resolve_port(container, handler["httpGet"]["port"])
        except ProbeConfigError as exc:
            raise ConfigError(str(exc)) from exc


def pre_stop(container: dict[str, Any], target: HookTarget, budget_s: float, cancel: threading.Event) -> None:
    """Run the container's preStop hook, for at most budget_s seconds (or until `cancel`)."""
    handler = (container.get("lifecycle") or {}).get("preStop")
    if handler is None or budget_s <= 0:
        return
    name = container["name"]
    try:
        if "sleep" in handler:
            cancel.wait(min(budget_s, float(handler["sleep"]["seconds"])))
        elif "httpGet" in handler:
            get = handler["httpGet"]
            port = resolve_port(container, get["port"])
            scheme, host = get.get("scheme", "HTTP").lower(), get.get("host") or target.ip
            url = f"{scheme}://{host}:{port}{get.get('path', '/')}"
            headers = {h["name"]: h["value"] for h in get.get("httpHeaders", [])}
            resp = httpx.get(url, headers=headers, timeout=budget_s, verify=False)
            if not 200 <= resp.status_code < 400:
                log.warning("container %s: preStop httpGet %s answered %d", name, url, resp.status_code)
        elif "exec" in handler and target.pid1 is not None:
            enter = ["nsenter", "-t", str(target.pid1), "-m", "-u", "-i", "-n", "-p"]
            enter += ["-S", str(target.uid), "-G", str(target.gid), "--"]
            proc = subprocess.run(
                [*enter, *handler["exec"]["command"]], capture_output=True, timeout=budget_s
            )
            if proc.returncode:
                log.warning(
                    "container %s: preStop exec exited %d: %s", name, proc.returncode, proc.stderr[-500:]
                )
    except (httpx.HTTPError, OSError, subprocess.TimeoutExpired, ProbeConfigError) as exc:
        log.warning("container %s: preStop hook failed: %s", name, exc)
