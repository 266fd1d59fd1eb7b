"""A pod's volumes as host directories and files, ready to bind-mount into its containers.

- hostPath: the path on the pod's node, which is `node_root/path` (each fake node has its own root
  on this one machine, so two nodes never share a socket directory), with the `type` checks and
  creations of a kubelet (DirectoryOrCreate 0755, FileOrCreate 0644, Directory/File/Socket/
  CharDevice/BlockDevice must already be that); no type: created as a directory when missing.
- emptyDir: a fresh 0777 directory under the pod's directory (medium Memory: a tmpfs is not needed
  for correctness here; the directory lives as long as the pod).
- configMap, secret, downwardAPI and projected (serviceAccountToken through TokenRequest bound to the
  pod, configMap, secret, downwardAPI): files written under the pod's directory with `items`,
  `mode`/`defaultMode` and `optional` honoured, laid out as the kubelet's atomic writer lays them out
  (the files in a `..<timestamp>` directory, `..data` a symlink to it, each top-level name a symlink
  through `..data`), so an update is one rename and a reader never sees half of one. configMap and
  secret volumes are refreshed while the pod runs (`refresh`, every CONFIG_SYNC_S: the kubelet's sync
  period, shortened for tests); a subPath mount of one would not be, as in Kubernetes. The token is
  not refreshed (tests run far shorter than its hour).
Any other volume kind (persistentVolumeClaim, csi, ...) is refused by name with VolumeError.
"""

from __future__ import annotations

import os
import shutil
import stat
import time
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


Files = dict[str, tuple[bytes, int]]  # path inside the volume -> (content, mode)
DATA_LINK = "..data"


def _add(files: Files, rel: str, data: bytes, mode: int) -> None:
    parts = Path(rel).parts
    if not parts or Path(rel).is_absolute() or ".." in parts or parts[0].startswith(".."):
        raise VolumeError(f"item path {rel!r} leaves its volume")
    files[rel] = (data, mode)


def _keys(
    api: PodApi, kind: str, namespace: str, source: dict[str, Any], files: Files, default_mode: int
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
        _add(files, item["path"], data[item["key"]], item.get("mode", default_mode))


def _downward(pod: dict[str, Any], items: list[dict[str, Any]], files: Files, default_mode: int) -> None:
    for item in items:
        if "fieldRef" not in item:
            raise VolumeError(f"downwardAPI item {item['path']}: only fieldRef is supported")
        value = field_value(pod, item["fieldRef"]["fieldPath"]).encode()
        _add(files, item["path"], value, item.get("mode", default_mode))


def _projected(pod: dict[str, Any], volume: dict[str, Any], files: Files, api: PodApi) -> None:
    namespace = pod["metadata"]["namespace"]
    mode = volume.get("defaultMode", 0o644)
    for source in volume.get("sources", []):
        if "serviceAccountToken" in source:
            sat = source["serviceAccountToken"]
            token = api.token(pod, sat.get("audience"), sat.get("expirationSeconds", 3600))
            _add(files, sat["path"], token.encode(), mode)
        elif "configMap" in source:
            _keys(api, "ConfigMap", namespace, source["configMap"], files, mode)
        elif "secret" in source:
            _keys(api, "Secret", namespace, source["secret"], files, mode)
        elif "downwardAPI" in source:
            _downward(pod, source["downwardAPI"].get("items", []), files, mode)
        else:
            raise VolumeError(f"projected source {sorted(source)} is not supported by the pod runner")


def _object_files(api: PodApi, namespace: str, volume: dict[str, Any]) -> Files | None:
    """A configMap or secret volume's files now; None for other kinds."""
    files: Files = {}
    if "configMap" in volume:
        source = volume["configMap"]
        _keys(api, "ConfigMap", namespace, source, files, source.get("defaultMode", 0o644))
    elif "secret" in volume:
        source = {**volume["secret"], "name": volume["secret"]["secretName"]}
        _keys(api, "Secret", namespace, source, files, volume["secret"].get("defaultMode", 0o644))
    else:
        return None
    return files


def _written(directory: Path) -> Files | None:
    """What the last atomic write left in `directory` (None: nothing yet)."""
    data = directory / DATA_LINK
    if not data.is_symlink():
        return None
    root = data.resolve()
    return {
        str(path.relative_to(root)): (path.read_bytes(), stat.S_IMODE(path.stat().st_mode))
        for path in root.rglob("*")
        if path.is_file()
    }


def atomic_write(directory: Path, files: Files) -> bool:
    """Lay `files` out as the kubelet's atomic writer does; False (and nothing touched) when they are
    what `directory` already holds. The switch is one rename of the `..data` link."""
    if _written(directory) == files:
        return False
    old = (directory / DATA_LINK).resolve() if (directory / DATA_LINK).is_symlink() else None
    stamp = directory / (
        time.strftime("..%Y_%m_%d_%H_%M_%S.", time.gmtime()) + f"{time.time_ns() % 10**9:09d}"
    )
    stamp.mkdir(mode=0o755)
    for rel, (data, mode) in files.items():
        target = stamp / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        target.chmod(mode)
    tmp = directory / f"{DATA_LINK}_tmp"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(stamp.name)
    os.replace(tmp, directory / DATA_LINK)
    tops = {Path(rel).parts[0] for rel in files}
    for entry in directory.iterdir():
        if entry.is_symlink() and not entry.name.startswith("..") and entry.name not in tops:
            entry.unlink()  # a key the object no longer has
    for top in tops:
        if not (directory / top).is_symlink():
            (directory / top).symlink_to(f"{DATA_LINK}/{top}")
    if old is not None and old != stamp:
        shutil.rmtree(old, ignore_errors=True)
    return True


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
        files: Files | None = _object_files(api, namespace, volume)
        if "emptyDir" in volume:
            directory.chmod(0o777)
        elif "downwardAPI" in volume:
            dapi = volume["downwardAPI"]
            files = {}
            _downward(pod, dapi.get("items", []), files, dapi.get("defaultMode", 0o644))
        elif "projected" in volume:
            files = {}
            _projected(pod, volume["projected"], files, api)
        elif files is None:
            kinds = sorted(k for k in volume if k != "name")
            raise VolumeError(f"volume {name}: kind {kinds} is not supported by the pod runner")
        if files is not None:
            atomic_write(directory, files)
        prepared[name] = directory
    return prepared


def refresh(pod: dict[str, Any], pod_dir: Path, api: PodApi) -> list[str]:
    """Rewrite the pod's configMap and secret volumes whose object changed; the names rewritten. An
    object that is gone or unreadable leaves its files as they are (the kubelet's behaviour)."""
    namespace = pod["metadata"]["namespace"]
    changed = []
    for volume in pod["spec"].get("volumes", []):
        try:
            files = _object_files(api, namespace, volume)
        except VolumeError:
            continue
        if files is not None and atomic_write(pod_dir / "volumes" / volume["name"], files):
            changed.append(volume["name"])
    return changed


def refreshable(pod: dict[str, Any]) -> bool:
    """Whether the pod has volumes `refresh` keeps in step with their objects."""
    return any("configMap" in v or "secret" in v for v in pod["spec"].get("volumes", []))
