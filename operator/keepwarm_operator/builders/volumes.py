"""How a model source appears inside a pod: a volume and its mount, at the directory keepwarm_api.paths
names (the node agent loads from the same directories)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from keepwarm_api.common import ModelSource, PVCSource
from keepwarm_api.inferencedeployment import LoraAdapter
from keepwarm_api.paths import (
    HF_MOUNT,
    HOST_MODELS_MOUNT,
    KERNELS_MOUNT,
    LORA_ROOT,
    cached_adapter_dir,
    host_model_dir,
    kernel_cache_dir,
    lora_dir,
    source_dir,
)


@dataclass(frozen=True)
class ModelMount:
    volume: dict[str, Any] | None  # pod volume (None when shared, e.g. the HF download dir)
    mount: dict[str, Any] | None  # container volumeMount
    path: str  # directory inside the container with the checkpoint's (or the adapter's) files


def model_mount(name: str, source: ModelSource) -> ModelMount:
    """Volume and mount for one model; read-only: pods never write checkpoints."""
    return source_mount(f"model-{name}"[:63], source, source_dir(name, source))


def source_mount(volume_name: str, source: ModelSource, path: str) -> ModelMount:
    """A model source's files at `path` (source_dir's answer for it): a path source's host directory
    (the same files the agent reads), a claim, or a Hub snapshot inside the shared download mount."""
    if source.path is not None:
        volume = {"name": volume_name, "hostPath": {"path": source.path, "type": "Directory"}}
        return ModelMount(volume, {"name": volume_name, "mountPath": path, "readOnly": True}, path)
    if source.pvc is not None:
        return pvc_mount(volume_name, source.pvc, path)
    return ModelMount(None, None, path)  # Hugging Face: inside the shared download mount


def lora_mount(
    adapter: LoraAdapter, cached: ModelSource | None = None, model_directory: str = ""
) -> ModelMount:
    """Volume and mount for one LoRA adapter; read-only, like models. Only a claim needs a volume of
    its own: a containerPath is in the image, and ``cached`` (the WeightCache source its
    source.cached names) is read where the agent reads it: a path under the cache's
    ``model_directory`` in the host_models_volume, a Hub adapter in the download mount, a claim the
    same claim. So adding or removing an adapter that is not on a claim changes no pod volume."""
    source, volume_name = adapter.source, f"lora-{adapter.name}"  # fits: LORA_NAME_MAX
    if source.container_path is not None:
        return ModelMount(None, None, source.container_path)
    if cached is not None and cached.path is not None:
        return ModelMount(None, None, host_model_dir(cached.path, model_directory))
    if cached is not None:
        return source_mount(volume_name, cached, source_dir(adapter.name, cached, models_root=LORA_ROOT))
    if source.pvc is None:  # the CRD's CEL rules make this unreachable
        raise ValueError(f"LoRA adapter {adapter.name!r}: source needs one of cached, pvc, containerPath")
    return pvc_mount(volume_name, source.pvc, lora_dir(adapter.name))


def cached_adapter_mount(model: str, adapter: str, pvc: PVCSource) -> ModelMount:
    """A WeightCache model's adapter on a claim, in agent pods (paths.cached_adapter_dir). Its volume
    name is a digest of model and adapter: "<model>-<adapter>" could pass 63 characters, and two
    pairs could spell the same one."""
    digest = hashlib.sha256(f"{model}/{adapter}".encode()).hexdigest()[:16]
    return pvc_mount(f"adapter-{digest}", pvc, cached_adapter_dir(model, adapter))


def pvc_mount(volume_name: str, pvc: PVCSource, path: str) -> ModelMount:
    """A claim mounted read-only at `path` (its subPath when set): a model's or an adapter's."""
    volume = {"name": volume_name, "persistentVolumeClaim": {"claimName": pvc.claim_name, "readOnly": True}}
    mount = {"name": volume_name, "mountPath": path, "readOnly": True}
    if pvc.sub_path:
        mount["subPath"] = pvc.sub_path
    return ModelMount(volume, mount, path)


def host_models_volume(model_directory: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A WeightCache's modelDirectory, read-only at HOST_MODELS_MOUNT: agents find every path model
    there, runtime pods every cached path adapter (paths.host_model_dir), whichever are listed."""
    volume = {"name": "host-models", "hostPath": {"path": model_directory, "type": "DirectoryOrCreate"}}
    return volume, {"name": "host-models", "mountPath": HOST_MODELS_MOUNT, "readOnly": True}


def hf_volume(host_dir: str, read_only: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    volume = {"name": "hf-cache", "hostPath": {"path": host_dir, "type": "DirectoryOrCreate"}}
    return volume, {"name": "hf-cache", "mountPath": HF_MOUNT, "readOnly": read_only}


def kernels_volume(download_directory: str, read_only: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """The node's CPU kernel builds (paths.kernel_cache_dir): a hostPath, so a build outlives the pod
    that made it; written by the agent pod only, read-only in runtime pods."""
    host = kernel_cache_dir(download_directory)
    volume = {"name": "keepwarm-kernels", "hostPath": {"path": host, "type": "DirectoryOrCreate"}}
    return volume, {"name": "keepwarm-kernels", "mountPath": KERNELS_MOUNT, "readOnly": read_only}
