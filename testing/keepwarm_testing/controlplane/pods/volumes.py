"""A pod's volumes as host directories and files, ready to bind-mount into its containers.

- hostPath: the path on the pod's node, which is `node_root/path` (each fake node has its own root
  on this one machine, so two nodes never share a socket directory), with the `type` checks and
  creations of a kubelet (DirectoryOrCreate 0755, FileOrCreate 0644, Directory/File/Socket/
  CharDevice/BlockDevice must already be that); no type: created as a directory when missing.
- emptyDir: a fresh 0777 directory under the pod's directory (medium Memory: a tmpfs is not needed
  for correctness here; the directory lives as long as the pod).
- configMap, secret, downwardAPI and projected (serviceAccountToken through TokenRequest bound to the
  pod, configMap, secret, downwardAPI): files written under the pod's directory with `items`,
  `mode`/`defaultMode` and `optional` honoured. The token is not refreshed (tests run far shorter
  than its hour).
Any other volume kind (persistentVolumeClaim, csi, ...) is refused by name with VolumeError.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, Protocol

from .env import field_value


class VolumeError(RuntimeError):
    """A volume cannot be set up (missing hostPath of a checked type, missing ConfigMap...)."""


class PodApi(Protocol):
    def lookup(self, kind: str, namespace: str, name: str) -> dict[str, bytes] | None: ...

    def token(self, pod: dict[str, Any], audience: str | None, expiration_s: int) -> str: ...


HOSTPATH_CHECKS = {
    "Directory": stat.S_ISDIR,
    "File": stat.S_ISREG,
    "Socket": stat.S_ISSOCK,
    "CharDevice": stat.S_ISCHR,
    "BlockDevice": stat.S_ISBLK,
}


def host_path(node_root: Path | None, path: str) -> Path:
    return Path(path) if node_root is None else node_root / path.lstrip("/")


def prepare_host_path(node_root: Path | None, source: dict[str, Any]) -> Path:
    path = host_path(node_root, source["path"])
    kind = source.get("type", "")
    if kind in ("", "DirectoryOrCreate") and not path.exists():
        path.mkdir(mode=0o755, parents=True)
    elif kind == "FileOrCreate" and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o644)
    elif kind in HOSTPATH_CHECKS:
        try:
            mode = path.stat().st_mode
        except FileNotFoundError:
            raise VolumeError(f"hostPath type check failed: {source['path']} does not exist") from None
        if not HOSTPATH_CHECKS[kind](mode):
            raise VolumeError(f"hostPath type check failed: {source['path']} is not a {kind}")
    elif kind not in ("", "DirectoryOrCreate", "FileOrCreate"):
        raise VolumeError(f"hostPath type {kind!r} is not supported")
    return Path(os.path.realpath(path))


def _write(directory: Path, rel: str, data: bytes, mode: int) -> None:
    target = (directory / rel).resolve()
    if directory.resolve() not in target.parents:
        raise VolumeError(f"item path {rel!r} leaves its volume")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
    target.chmod(mode)


def _keys(
    api: PodApi, kind: str, namespace: str, source: dict[str, Any], directory: Path, default_mode: int
) -> None:
    data = api.lookup(kind, namespace, source["name"])
    if data is None:
        if source.get("optional"):
            return
        raise VolumeError(f"{kind} {namespace}/{source['name']} not found")
    items = source.get("items") or [{"key": k, "path": k} for k in sorted(data)]
    for item in items:
        if item["key"] not in data:
            if source.get("optional"):
                continue
            raise VolumeError(f"{kind} {namespace}/{source['name']} has no key {item['key']!r}")
        _write(directory, item["path"], data[item["key"]], item.get("mode", default_mode))


def _downward(pod: dict[str, Any], items: list[dict[str, Any]], directory: Path, default_mode: int) -> None:
    for item in items:
        if "fieldRef" not in item:
            raise VolumeError(f"downwardAPI item {item['path']}: only fieldRef is supported")
        value = field_value(pod, item["fieldRef"]["fieldPath"]).encode()
        _write(directory, item["path"], value, item.get("mode", default_mode))


def _projected(pod: dict[str, Any], volume: dict[str, Any], directory: Path, api: PodApi) -> None:
    namespace = pod["metadata"]["namespace"]
    mode = volume.get("defaultMode", 0o644)
    for source in volume.get("sources", []):
        if "serviceAccountToken" in source:
            sat = source["serviceAccountToken"]
            token = api.token(pod, sat.get("audience"), sat.get("expirationSeconds", 3600))
            _write(directory, sat["path"], token.encode(), mode)
        elif "configMap" in source:
            _keys(api, "ConfigMap", namespace, source["configMap"], directory, mode)
        elif "secret" in source:
            _keys(api, "Secret", namespace, source["secret"], directory, mode)
        elif "downwardAPI" in source:
            _downward(pod, source["downwardAPI"].get("items", []), directory, mode)
        else:
            raise VolumeError(f"projected source {sorted(source)} is not supported by the pod runner")


def prepare(pod: dict[str, Any], node_root: Path | None, pod_dir: Path, api: PodApi) -> dict[str, Path]:
    """Every volume of the pod: name -> host path to bind-mount."""
    namespace = pod["metadata"]["namespace"]
    prepared: dict[str, Path] = {}
    for volume in pod["spec"].get("volumes", []):
        name = volume["name"]
        directory = pod_dir / "volumes" / name
        if "hostPath" in volume:
            prepared[name] = prepare_host_path(node_root, volume["hostPath"])
            continue
        directory.mkdir(parents=True, exist_ok=True)
        if "emptyDir" in volume:
            directory.chmod(0o777)
        elif "configMap" in volume:
            src = {**volume["configMap"], "name": volume["configMap"]["name"]}
            _keys(api, "ConfigMap", namespace, src, directory, volume["configMap"].get("defaultMode", 0o644))
        elif "secret" in volume:
            src = {**volume["secret"], "name": volume["secret"]["secretName"]}
            _keys(api, "Secret", namespace, src, directory, volume["secret"].get("defaultMode", 0o644))
        elif "downwardAPI" in volume:
            dapi = volume["downwardAPI"]
            _downward(pod, dapi.get("items", []), directory, dapi.get("defaultMode", 0o644))
        elif "projected" in volume:
            _projected(pod, volume["projected"], directory, api)
        else:
            kinds = sorted(k for k in volume if k != "name")
            raise VolumeError(f"volume {name}: kind {kinds} is not supported by the pod runner")
        prepared[name] = directory
    return prepared
