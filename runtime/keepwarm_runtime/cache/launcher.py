"""Start `keepwarm cache serve` (or `keepwarm cache hold`) as a child process and wait for its READY line.

The twin of ``server/launcher.py`` for the cache daemon, shared by the restart benchmark and the
tests. The daemon binds its socket only once every model is loaded and then prints one line starting
with ``READY`` on stderr, so that line (not the socket file) is the readiness signal. Whether a daemon
has imported torch (it needs it only to read a checkpoint) shows in its memory map
(``imported_torch``).
"""

from __future__ import annotations

import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from keepwarm_api.sockets import HOST_SOCKET

READY_PREFIX = "READY "
TORCH_LIBRARY = "libtorch_cpu"  # mapped by `import torch` in every build (its CPU kernels live there)


class DaemonStartError(RuntimeError):
    """The daemon exited or did not print READY in time; the message ends with its stderr."""


def serve_command(socket_dir: Path, models: list[Path], *extra: str, tier: str = "host") -> list[str]:
    """argv of `keepwarm cache serve` for these models, run by this interpreter."""
    command = [sys.executable, "-m", "keepwarm_runtime.cli", "cache", "serve"]
    command += ["--socket-dir", str(socket_dir), "--tier", tier]
    for model in models:
        command += ["--model", str(model)]
    return [*command, *extra]


class DaemonProcess:
    """`keepwarm cache serve` in a subprocess; its stderr is collected line by line."""

    def __init__(
        self,
        socket_dir: Path,
        models: list[Path],
        *extra: str,
        tier: str = "host",
        nofile: int | None = None,
    ) -> None:
        """``nofile`` sets the daemon's open-files limit (soft and hard), e.g. to test exhaustion."""
        self._start(socket_dir, serve_command(socket_dir, models, *extra, tier=tier), nofile)

    def _start(self, socket_dir: Path, command: list[str], nofile: int | None) -> None:
        self.socket_dir = socket_dir
        self.started = time.perf_counter()
        self.ready_s: float | None = None
        self.proc = subprocess.Popen(
            command,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=(lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile)))
            if nofile
            else None,
        )
        self.lines: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            if line.startswith(READY_PREFIX) and self.ready_s is None:
                self.ready_s = time.perf_counter() - self.started
                self._ready.set()
        self._ready.set()  # exited

    def wait_ready(self, timeout_s: float = 180.0) -> DaemonProcess:
        """Block until READY; raise DaemonStartError if the daemon exits or times out first."""
        self._ready.wait(timeout_s)
        if self.ready_s is None or self.proc.poll() is not None:
            raise DaemonStartError(f"cache daemon did not become ready:\n{self.stderr}")
        return self

    def wait_exit(self, timeout_s: float = 180.0) -> int:
        rc = self.proc.wait(timeout_s)
        self._ready.wait(5)  # let the pump read the last lines
        return rc

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    def imported_torch(self) -> bool:
        """torch's library is mapped in the daemon now: it imported torch (``import`` never unmaps)."""
        return TORCH_LIBRARY in Path(f"/proc/{self.proc.pid}/maps").read_text()

    @property
    def socket(self) -> Path:
        """The host tier's socket (gpu-tier sockets are named after the GPU's UUID)."""
        return self.socket_dir / HOST_SOCKET

    def terminate(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.wait_exit(timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


class HolderProcess(DaemonProcess):
    """`keepwarm cache hold` (cache/holder.py) in a subprocess; READY once it listens."""

    def __init__(self, socket_dir: Path, *extra: str) -> None:
        command = [
            sys.executable,
            "-m",
            "keepwarm_runtime.cli",
            "cache",
            "hold",
            "--socket-dir",
            str(socket_dir),
        ]
        self._start(socket_dir, [*command, *extra], None)
