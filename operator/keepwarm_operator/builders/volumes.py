"""How a model source appears inside a pod: a volume, its mount, and the directory to load from.

Agents and runtime pods use the same convention (`/models/<model name>`), so a path the agent
fingerprinted is the path the runtime reads on fallback.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..api.common import ModelSource

MODELS_ROOT = "/models"
HF_MOUNT = "/var/cache/keepwarm"


@dataclass(frozen=True)
class ModelMount:
    volume: dict[str, Any] | None  # pod volume (None when shared, e.g. the HF download dir)
    mount: dict[str, Any] | None  # container volumeMount
    path: str  # directory inside the container with config.json + safetensors


def hf_snapshot_dir(repo: str, revision: str, root: str = HF_MOUNT) -> str:
    """huggingface_hub's cache layout; revision should be a commit sha for this path to exist."""
    return f"{root}/huggingface/models--{repo.replace('/', '--')}/snapshots/{revision}"


def model_mount(name: str, source: ModelSource) -> ModelMount:
    """Volume and mount for one model; read-only: pods never write checkpoints."""
    volume_name = f"model-{name}"[:63]
    path = f"{MODELS_ROOT}/{name}"
    if source.path is not None:
        volume = {"name": volume_name, "hostPath": {"path": source.path, "type": "Directory"}}
        return ModelMount(volume, {"name": volume_name, "mountPath": path, "readOnly": True}, path)
    if source.pvc is not None:
        volume = {
            "name": volume_name,
            "persistentVolumeClaim": {"claimName": source.pvc.claim_name, "readOnly": True},
        }
        mount = {"name": volume_name, "mountPath": path, "readOnly": True}
        if source.pvc.sub_path:
            mount["subPath"] = source.pvc.sub_path
        return ModelMount(volume, mount, path)
    hf = source.hugging_face
    if hf is None:  # the CRD's CEL rule makes this unreachable for stored objects
        raise ValueError(f"model {name!r}: source needs one of path, pvc, huggingFace")
    return ModelMount(None, None, hf_snapshot_dir(hf.repo, hf.revision))


def hf_volume(host_dir: str, read_only: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    volume = {"name": "hf-cache", "hostPath": {"path": host_dir, "type": "DirectoryOrCreate"}}
    return volume, {"name": "hf-cache", "mountPath": HF_MOUNT, "readOnly": read_only}
