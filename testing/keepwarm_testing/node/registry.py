"""An image registry on loopback: Debian's `docker-registry` (the CNCF distribution registry, v2 API).

Its storage lives in ~/.cache/keepwarm/registry and outlasts the process, and it listens on one port
(PORT, else a free one): buildah remembers which layers a registry holds by its address, so a push of an
image whose big layers the registry already has sends only the new ones instead of compressing gigabytes
again. Blobs no tag refers to any more are collected at each start. Nodes reach it as the mirror of the
registries the chart and the CRDs name (node/containerd.py), as an air-gapped cluster reaches its own.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx

from keepwarm_runtime.server.launcher import free_port

STORAGE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "keepwarm" / "registry"
PORT = 15000


class RegistryError(RuntimeError):
    """The registry did not start or answer; the message carries its log's tail."""


class LocalRegistry:
    """`with LocalRegistry(workdir) as registry:`; `registry.host` is its 127.0.0.1:PORT."""

    def __init__(self, workdir: Path, storage: Path = STORAGE) -> None:
        self.workdir, self.storage = workdir, storage
        self.port = PORT if _free(PORT) else free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> LocalRegistry:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def start(self, timeout_s: float = 30.0) -> LocalRegistry:
        binary = shutil.which("docker-registry")
        if binary is None:
            raise RegistryError(
                "docker-registry is missing: `make nodetools` installs Debian's docker-registry"
            )
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.storage.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "registry.json"  # YAML is a superset of JSON
        config.write_text(
            json.dumps(
                {
                    "version": 0.1,
                    "log": {"level": "warn"},
                    "storage": {
                        "filesystem": {"rootdirectory": str(self.storage)},
                        "delete": {"enabled": True},
                    },
                    "http": {"addr": self.host},
                }
            )
        )
        # Layers of images whose tags moved on: the registry must not serve while it collects.
        subprocess.run([binary, "garbage-collect", "--delete-untagged", str(config)], capture_output=True)
        log = open(self.workdir / "registry.log", "ab")  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen(
            [binary, "serve", str(config)], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if httpx.get(f"http://{self.host}/v2/", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        tail = (self.workdir / "registry.log").read_text(errors="replace")[-2000:]
        self.stop()
        raise RegistryError(f"docker-registry did not answer on {self.host}:\n{tail}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def config_digest(self, reference: str) -> str | None:
        """The config digest (the image id) of the manifest `repository:tag` names; None without one."""
        repository, _, tag = reference.rpartition(":")
        accept = (
            "application/vnd.docker.distribution.manifest.v2+json, application/vnd.oci.image.manifest.v1+json"
        )
        resp = httpx.get(f"http://{self.host}/v2/{repository}/manifests/{tag}", headers={"Accept": accept})
        return resp.json().get("config", {}).get("digest") if resp.status_code == 200 else None


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
