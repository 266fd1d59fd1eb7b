"""Real daemon processes for the cache integration tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

READY_TIMEOUT_S = 180.0  # a fresh process imports torch: slow on a busy 2-core machine


class DaemonProcess:
    """`keepwarm cache serve` in a subprocess; stderr is collected line by line."""

    def __init__(self, socket_dir: Path, models: list[Path], *extra: str) -> None:
        self.socket_dir = socket_dir
        cmd = [
            sys.executable,
            "-m",
            "keepwarm_runtime.cli",
            "cache",
            "serve",
            "--socket-dir",
            str(socket_dir),
            "--tier",
            "host",
        ]
        for m in models:
            cmd += ["--model", str(m)]
        self.proc = subprocess.Popen([*cmd, *extra], stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            if line.startswith("READY "):
                self._ready.set()
        self._ready.set()  # exited

    def wait_ready(self) -> DaemonProcess:
        self._ready.wait(READY_TIMEOUT_S)
        if self.proc.poll() is not None or not any(x.startswith("READY ") for x in self.lines):
            raise AssertionError(f"daemon did not become ready:\n{self.stderr}")
        return self

    def wait_exit(self, timeout: float = READY_TIMEOUT_S) -> int:
        rc = self.proc.wait(timeout)
        deadline = time.monotonic() + 5
        while not self._ready.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)
        return rc

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    @property
    def socket(self) -> Path:
        return self.socket_dir / "host.sock"

    def terminate(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.wait_exit(30)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)


def write_checkpoint(path: Path, seed: int, rows: int = 64) -> Path:
    """A small safetensors checkpoint without transformers (the daemon only reads raw files)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    save_file(
        {
            "a.weight": torch.randn(rows, 1024, generator=g).bfloat16(),
            "b.steps": torch.arange(5, dtype=torch.int64),
        },
        path / "model.safetensors",
    )
    (path / "config.json").write_text('{"architectures": ["TinyForTest"], "model_type": "tiny"}')
    return path


@pytest.fixture
def daemon_factory():
    started: list[DaemonProcess] = []

    def start(socket_dir: Path, models: list[Path], *extra: str) -> DaemonProcess:
        d = DaemonProcess(socket_dir, models, *extra)
        started.append(d)
        return d

    yield start
    for d in started:
        d.kill()


@pytest.fixture(scope="session")
def checkpoint_writer():
    return write_checkpoint


class WarmCache:
    """One daemon shared by a test module: tiny Llama (pinned, served float32) plus two small models
    under a budget that fits only one of them, so loading the third evicted the second."""

    def __init__(self, root: Path, tiny: Path) -> None:
        from keepwarm_runtime.cache.checkpoint import read_checkpoint
        from keepwarm_runtime.cache.loader import plan_layout

        self.root = root
        self.socket_dir = root / "wc"
        self.tiny = tiny
        self.evicted = write_checkpoint(root / "models" / "evicted", seed=1, rows=512)  # 2 MiB in float32
        self.kept = write_checkpoint(root / "models" / "kept", seed=2, rows=511)  # other header
        tiny_bytes = plan_layout(read_checkpoint(tiny), torch.float32).size
        budget = tiny_bytes + (3 << 20)  # tiny + one 2 MiB model fit; tiny + two do not
        self.daemon = DaemonProcess(
            self.socket_dir,
            [tiny, self.evicted, self.kept],
            "--dtype",
            "float32",
            "--budget",
            str(budget),
            "--pin",
            tiny.name,
            "--group",
            "nogroup",
        ).wait_ready()


@pytest.fixture(scope="module")
def warm_cache(tiny_llama: Path):
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="keepwarm-it-"))
    os.chmod(root, 0o755)  # the `nobody` client must reach the socket dir (which is 0770 nogroup)
    cache = WarmCache(root, tiny_llama)
    yield cache
    cache.daemon.kill()
    import shutil

    shutil.rmtree(root, ignore_errors=True)
