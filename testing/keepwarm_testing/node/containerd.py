"""One node's containerd: its configuration (CRI with runc, the CNI network, registry mirrors) and process.

The content store and snapshots live in a per-node-name folder under ~/.cache/keepwarm/nodes that
outlasts the cluster (a lock keeps one containerd on it at a time; a second cluster with the same node
name gets a fresh folder), so a later cluster finds its images unpacked, as a node that ran them
before would; runtime state, sockets and logs live in the cluster's own folder. Images are pulled from
the local registry, which every registry the cluster names (`ghcr.io`, ...) resolves to: containerd's
hosts.toml mirrors, the way an air-gapped cluster pulls, and no request ever leaves the machine.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from . import process

NODES_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "keepwarm" / "nodes"
MIRRORED = ("ghcr.io", "docker.io", "registry.k8s.io")  # registries the cluster's objects may name
K8S_NAMESPACE = "k8s.io"  # containerd's namespace for the CRI's containers and images


class ContainerdError(RuntimeError):
    """containerd did not start or answer; the message carries its log's tail."""


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def config_toml(
    root: Path, state: Path, socket: Path, bin_dir: Path, cni_conf_dir: Path, certs_dir: Path, sandbox: str
) -> str:
    """containerd's configuration (version 3: containerd 2.x)."""
    cri_images = '[plugins."io.containerd.cri.v1.images"]'
    cri_runtime = '[plugins."io.containerd.cri.v1.runtime"]'
    runc = '[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]'
    return "\n".join(
        [
            "version = 3",
            f"root = {_toml(root)}",
            f"state = {_toml(state)}",
            # Snapshotters and services this node never uses, left out so none probes the machine.
            "disabled_plugins = "
            + _toml(
                [
                    "io.containerd.snapshotter.v1.btrfs",
                    "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.devmapper",
                    "io.containerd.snapshotter.v1.erofs",
                    "io.containerd.snapshotter.v1.blockfile",
                    "io.containerd.tracing.processor.v1.otlp",
                    "io.containerd.internal.v1.tracing",
                ]
            ),
            "[grpc]",
            f"  address = {_toml(socket)}",
            "[ttrpc]",
            f"  address = {_toml(socket.with_suffix('.ttrpc'))}",
            cri_images,
            '  snapshotter = "overlayfs"',
            "  discard_unpacked_layers = true",  # the unpacked snapshot is all a node needs: not twice the GB
            f"{cri_images[:-1]}.registry]",
            f"  config_path = {_toml(certs_dir)}",
            f"{cri_images[:-1]}.pinned_images]",
            f"  sandbox = {_toml(sandbox)}",
            cri_runtime,
            # This machine withholds CAP_SYS_RESOURCE even from root, so no process may lower its
            # oom_score_adj: a pod sandbox's -998 (and a Guaranteed pod's -997) are raised to
            # containerd's own instead of failing every sandbox (containerd's setting for rootless use).
            "  restrict_oom_score_adj = true",
            f"{cri_runtime[:-1]}.cni]",
            f"  bin_dirs = {_toml([bin_dir])}",
            f"  conf_dir = {_toml(cni_conf_dir)}",
            runc,
            '  runtime_type = "io.containerd.runc.v2"',
            f"{runc[:-1]}.options]",
            f"  BinaryName = {_toml(bin_dir / 'runc')}",
            "  SystemdCgroup = false",
            "",
        ]
    )


def hosts_toml(registry: str) -> str:
    """A registry's hosts.toml sending every pull to the local registry over plain HTTP."""
    return "\n".join(
        [
            f'server = "http://{registry}"',
            f'[host."http://{registry}"]',
            '  capabilities = ["pull", "resolve"]',
            "",
        ]
    )


@dataclass
class Containerd:
    """containerd for node `name`: `start()` writes its configuration and waits for its socket."""

    name: str
    workdir: Path  # the cluster's folder for this node (state, sockets, configuration, logs)
    bin_dir: Path
    cni_conf_dir: Path
    registry: str  # host:port of the local registry
    sandbox: str  # the pause image's reference
    proc: subprocess.Popen | None = None
    root: Path = field(init=False)
    _lock: IO[str] | None = None

    @property
    def socket(self) -> Path:
        return self.workdir / "containerd.sock"

    @property
    def endpoint(self) -> str:
        return f"unix://{self.socket}"

    def _take_root(self) -> Path:
        """The node name's persistent root if no other containerd holds it, else a fresh one here."""
        persistent = NODES_CACHE / self.name / "containerd"
        persistent.mkdir(parents=True, exist_ok=True)
        lock = open(persistent.parent / "lock", "w")  # noqa: SIM115 - held for containerd's lifetime
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            return self.workdir / "root"
        self._lock = lock
        return persistent

    def start(self, timeout_s: float = 60.0) -> Containerd:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.root = self._take_root()
        certs = self.workdir / "certs.d"
        for host in (*MIRRORED, self.registry):
            (certs / host).mkdir(parents=True, exist_ok=True)
            (certs / host / "hosts.toml").write_text(hosts_toml(self.registry))
        config = self.workdir / "containerd.toml"
        config.write_text(
            config_toml(
                self.root,
                self.workdir / "state",
                self.socket,
                self.bin_dir,
                self.cni_conf_dir,
                certs,
                self.sandbox,
            )
        )
        log = open(self.workdir / "containerd.log", "ab")  # noqa: SIM115 - the child owns it
        env = {**os.environ, "PATH": f"{self.bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
        self.proc = subprocess.Popen(
            [str(self.bin_dir / "containerd"), "--config", str(config)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if self.socket.exists() and self.ctr("version", check=False).returncode == 0:
                return self
            time.sleep(0.1)
        log = self.workdir / "containerd.log"
        raise ContainerdError(f"containerd of {self.name} did not start; log {log}:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        return process.log_tail(self.workdir / "containerd.log", lines)

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """containerd's own client on this node's socket, in the CRI's namespace."""
        cmd = [str(self.bin_dir / "ctr"), "--address", str(self.socket), "--namespace", K8S_NAMESPACE, *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if check and proc.returncode != 0:
            raise ContainerdError(f"{' '.join(cmd[3:])}: {proc.stderr.strip()}")
        return proc

    def stop(self) -> None:
        process.stop(self.proc, grace_s=20)
        self.proc = None
        if self._lock is not None:
            self._lock.close()
            self._lock = None
