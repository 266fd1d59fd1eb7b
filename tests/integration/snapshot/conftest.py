"""Real CRIU, real processes: a node (`keepwarm cache serve --snapshot-store`) and pods (`keepwarm serve
--snapshot-store` in fresh PID, mount and UTS namespaces, as root with only the capabilities a
runtime pod's restore gets: CHECKPOINT_RESTORE and SETPCAP in its bounding set; server/launcher.py POD).

Root only: namespaces, setpriv and the store's ownership need it. Taking a snapshot costs a whole
preload (tens of seconds on a loaded 2-core box), so a module takes one (``snapshot``) and the tests
that spoil a snapshot work on copies of it (``store_copy``)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from keepwarm_runtime.cache.launcher import DaemonProcess
from keepwarm_runtime.server.launcher import POD, ServerProcess, pod_init, start_server, stop_pod
from keepwarm_runtime.snapshot.store import snapshot_dirs
from keepwarm_testing.criu import build_criu

if os.geteuid() != 0:
    pytest.skip(
        "snapshots are taken and restored in namespaces, under other uids: root only", allow_module_level=True
    )

# The pods' engine settings: the torch attention backend builds no kernel.
SERVE_ARGS = (
    "--attention-backend", "torch", "--max-model-len", "256", "--num-kv-blocks", "64",
    "--served-model-name", "tiny",
)  # fmt: skip
TAKE_TIMEOUT_S = 600.0


@pytest.fixture(scope="session")
def criu() -> Path:
    return build_criu(timeout_s=3600)


@dataclass
class Node:
    """A node process serving the snapshot service on its socket directory."""

    daemon: DaemonProcess
    socket_dir: Path
    store: Path

    def wait_for(self, pattern: str, timeout: float = TAKE_TIMEOUT_S, count: int = 1) -> list[str]:
        """The node's log lines matching ``pattern`` once there are ``count`` of them."""
        deadline = time.monotonic() + timeout
        while True:
            found = [line for line in self.daemon.lines if re.search(pattern, line)]
            if len(found) >= count:
                return found
            if time.monotonic() > deadline or self.daemon.proc.poll() is not None:
                raise AssertionError(
                    f"no {count} lines {pattern!r} in the node's log:\n{self.daemon.stderr[-4000:]}"
                )
            time.sleep(0.2)

    def snapshots(self) -> list[Path]:
        return snapshot_dirs(self.store)

    def stop(self) -> None:
        """Stop the node and drop its store (snapshots are hundreds of MB; pytest keeps temp dirs)."""
        self.daemon.terminate()
        remove(self.store)


def start_node(root: Path, criu: Path | str, *extra: str, store: Path | None = None) -> Node:
    socket_dir = root / "sockets"
    store = store or root / "store"
    daemon = DaemonProcess(socket_dir, [], "--snapshot-store", str(store), "--criu", str(criu), *extra)
    return Node(daemon.wait_ready(), socket_dir, store)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, criu: Path) -> Iterator[Node]:
    node = start_node(tmp_path_factory.mktemp("node"), criu)
    yield node
    node.stop()


class Pod:
    """One `keepwarm serve` in a pod's namespaces; ``stop`` is the kubelet's SIGTERM to its PID 1."""

    def __init__(self, server: ServerProcess) -> None:
        self.server = server

    @property
    def launcher_pid(self) -> int:
        """The launcher: PID 1 of the pod's PID namespace."""
        return pod_init(self.server.proc)

    def stop(self, timeout: float = 60.0) -> int:
        return stop_pod(self.server.proc, timeout)


def start_pod(
    model: Path, log: Path, store: Path, criu: Path | str, socket_dir: Path | None = None, *args: str
) -> Pod:
    """A pod (`keepwarm serve` in its own namespaces) on ``store``, not waited for."""
    flags = ["--snapshot-store", str(store), "--criu", str(criu), *SERVE_ARGS, *args]
    if socket_dir is not None:
        flags += ["--cache-socket-dir", str(socket_dir)]
    return Pod(start_server(model, log, args=flags, prefix=POD))


@pytest.fixture
def pods(tmp_path: Path, tiny_llama: Path) -> Iterator[callable]:
    """``pods(store, criu, socket_dir, *args)``: start a pod (not waited for); all stopped at the end."""
    started: list[Pod] = []

    def start(
        store: Path, criu: Path | str, socket_dir: Path | None = None, *args: str, model: Path = tiny_llama
    ) -> Pod:
        pod = start_pod(model, tmp_path / f"pod-{len(started)}.log", store, criu, socket_dir, *args)
        started.append(pod)
        return pod

    yield start
    for pod in started:
        pod.stop()


def startup_source(server: ServerProcess) -> tuple[str, str]:
    return server.startup_source()


@pytest.fixture
def store_copy(tmp_path: Path) -> Iterator[callable]:
    """``store_copy(snapshot)``: a store of its own holding a copy of ``snapshot``, removed after the test."""
    made: list[Path] = []

    def make(snapshot: Path) -> Path:
        made.append(tmp_path / f"store-{len(made)}")
        return copy_store(snapshot, made[-1])

    yield make
    for store in made:
        remove(store)


def copy_store(snapshot: Path, to: Path) -> Path:
    """A store holding a copy of one snapshot (owners and modes kept); returns the copy's directory."""
    to.mkdir(parents=True, exist_ok=True)
    os.chmod(to, 0o755)
    copy = to / snapshot.name
    subprocess.run(["cp", "-a", str(snapshot), str(copy)], check=True)
    return copy


@contextlib.contextmanager
def writable(path: Path) -> Iterator[None]:
    """Make a sealed snapshot's files writable by root for a test's edit, then seal them again."""
    modes = {p: p.stat().st_mode for p in [path, *path.rglob("*")]}
    for p in modes:
        os.chmod(p, 0o700 if p.is_dir() else 0o600)
    try:
        yield
    finally:
        for p, mode in sorted(modes.items(), reverse=True):
            os.chmod(p, mode & 0o7777)


def remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
