"""Start `keepwarm serve` as a child process and wait for it: used by the demo, the benchmark and tests.
Under POD (root) the child runs as in a pod: its own PID, mount and UTS namespaces, and a pod's
restore capabilities only (process snapshots, docs/snapshots.md); ``stop_pod`` stops it as a kubelet.

Each server runs in its own session (process group) so ``stop()`` takes down anything it spawned;
its stdout and stderr go to a log file the caller can read (e.g. to count warnings).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from keepwarm_api.settings import SettingError, resolve
from keepwarm_runtime.server.cli import parse_serve_argv, serve_env_vars
from keepwarm_runtime.server.settings import ServeSettings

# A command prefix that runs a process as in a pod (root only): its own PID (the process is PID 1 there),
# mount and UTS namespaces, and of all capabilities only those a runtime container's restore gets.
POD = (
    "unshare", "--pid", "--fork", "--mount-proc", "--mount", "--uts", "--",
    "setpriv", "--bounding-set=-all,+checkpoint_restore,+setpcap", "--inh-caps=-all", "--",
)  # fmt: skip


class ServerStartError(RuntimeError):
    """The server exited or did not become ready in time; the message ends with its log tail."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    """(status, body); status 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    url: str  # http://127.0.0.1:PORT
    log_path: Path
    started_at: float = field(default_factory=time.monotonic)  # when the process was spawned
    parent_url: str | None = None  # the supervising parent's own /health (None: --no-supervise)

    def wait(self, path: str = "/ready", timeout: float = 180.0) -> float:
        """Poll ``path`` until 200; returns seconds since spawn. Raises ServerStartError."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(
                    f"keepwarm serve exited with {self.proc.returncode}\n{self.log_tail()}"
                )
            status, _ = http_get(self.url + path, timeout=1.0)
            if status == 200:
                return time.monotonic() - self.started_at
            time.sleep(0.05)
        raise ServerStartError(f"{self.url}{path} not 200 after {timeout:.0f}s\n{self.log_tail()}")

    def get_json(self, path: str) -> dict:
        status, body = http_get(self.url + path)
        if status != 200:
            raise RuntimeError(f"GET {path}: {status} {body[:200]!r}")
        return json.loads(body)

    def metrics(self) -> dict[str, float]:
        """Prometheus samples as {'name{labels}': value} (labels as printed)."""
        status, body = http_get(self.url + "/metrics")
        samples = {}
        for line in body.decode().splitlines() if status == 200 else []:
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                samples[name] = float(value)
        return samples

    def parent_health(self) -> tuple[int, dict]:
        """(status, body) of the supervising parent's /health; (0, {}) when it does not answer."""
        if self.parent_url is None:
            raise RuntimeError("this server runs without a supervising parent")
        status, body = http_get(self.parent_url + "/health")
        return status, json.loads(body) if status else {}

    def worker_pid(self) -> int:
        """The serving process: the supervisor's current worker, or the server itself."""
        if self.parent_url is None:
            return self.proc.pid
        status, body = self.parent_health()
        if not body.get("worker_pid"):
            raise RuntimeError(f"the parent names no worker now ({status} {body})")
        return int(body["worker_pid"])

    def startup_source(self) -> tuple[str, str]:
        """(source, reason) of the ready server's keepwarm_startup_source_total: how its parent started."""
        rows = [
            dict(re.findall(r'(\w+)="([^"]*)"', name))
            for name, value in self.metrics().items()
            if name.startswith("keepwarm_startup_source_total{") and value == 1
        ]
        if len(rows) != 1:
            raise RuntimeError(f"one keepwarm_startup_source_total series expected, got {rows}")
        return rows[0]["source"], rows[0]["reason"]

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM the server's process group, SIGKILL after ``timeout``; returns the exit code."""
        if self.proc.poll() is None:
            _signal_group(self.proc, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc, signal.SIGKILL)
                self.proc.wait(5)
        return self.proc.returncode


def start_server(
    model_dir: str | Path,
    log_path: str | Path,
    *,
    port: int | None = None,
    args: list[str] | tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    prefix: Sequence[str] = (),
) -> ServerProcess:
    """Spawn `keepwarm serve MODEL_DIR --host 127.0.0.1 --port PORT ARGS` (does not wait), under
    ``prefix`` when given (e.g. ``unshare ... --``: a pod's namespaces); the supervising parent's
    /health gets a free port of its own unless ARGS or ENV name one."""
    port = port or free_port()
    supervised, parent_port = child_supervision(model_dir, args, env or {})
    if supervised and parent_port is None:
        parent_port = free_port()
        args = [*args, "--supervisor-port", str(parent_port)]
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = [
        *prefix,
        sys.executable,
        "-m",
        "keepwarm_runtime.cli",
        "serve",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *args,
    ]
    # The parent's serve settings (KEEPWARM_PORT, KEEPWARM_CACHE_SOCKET_DIR, ...) must not leak in.
    serve_vars = serve_env_vars()  # builds the serve parser: once, not per environment variable
    child_env = {k: v for k, v in os.environ.items() if k not in serve_vars}
    child_env |= {"PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=child_env, start_new_session=True
        )
    parent_url = None if parent_port is None else f"http://127.0.0.1:{parent_port}"
    return ServerProcess(proc, f"http://127.0.0.1:{port}", log_path, parent_url=parent_url)


def child_supervision(
    model_dir: str | Path, args: Sequence[str], env: dict[str, str]
) -> tuple[bool, int | None]:
    """Whether the child will run a supervising parent, and the port of that parent's /health if ARGS
    or ENV name one: the child's own settings, resolved by the settings layer from what it will get
    (no serve variable of this process reaches it). Settings it will refuse: (False, None)."""
    try:
        settings = resolve(ServeSettings, parse_serve_argv([str(model_dir), *args]), env)
    except (SettingError, SystemExit):  # the child says why, and exits 2
        return False, None
    return settings.supervise, settings.supervisor_port if settings.supervise else None


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def pod_init(proc: subprocess.Popen) -> int:
    """The PID 1 of a pod started under POD: ``unshare``'s one child."""
    return int(Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()[0])


def stop_pod(proc: subprocess.Popen, timeout: float = 60.0) -> int:
    """Stop a pod started under POD as the kubelet does: SIGTERM to its PID 1, SIGKILL to everything
    after ``timeout``; returns the PID 1's exit code (unshare's)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, FileNotFoundError, IndexError, ValueError):
            os.kill(pod_init(proc), signal.SIGTERM)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            return proc.wait(10)
    return proc.returncode
