"""Where a model's files appear inside agent and runtime pods: one convention for both.

The operator mounts path and pvc sources at `<MODELS_ROOT>/<model name>` and the node's download
directory at HF_MOUNT; the agent loads from those same directories, so a path the agent fingerprinted
is the path a runtime pod reads on fallback.
"""

from __future__ import annotations

from .common import ModelSource

MODELS_ROOT = "/models"  # path and pvc sources, one directory per model name
HF_MOUNT = "/var/cache/keepwarm"  # the node's download directory (WeightCache spec.downloadDirectory)


def model_dir(name: str, root: str = MODELS_ROOT) -> str:
    """The directory a path or pvc source of model `name` is mounted at."""
    return f"{root}/{name}"


def hf_cache_dir(root: str = HF_MOUNT) -> str:
    """huggingface_hub's cache_dir under the download mount (the agent downloads into it)."""
    return f"{root}/huggingface"


def hf_snapshot_dir(repo: str, revision: str, root: str = HF_MOUNT) -> str:
    """huggingface_hub's cache layout; revision should be a commit sha for this path to exist."""
    return f"{hf_cache_dir(root)}/models--{repo.replace('/', '--')}/snapshots/{revision}"


def source_dir(
    name: str, source: ModelSource, models_root: str = MODELS_ROOT, hf_root: str = HF_MOUNT
) -> str:
    """The directory holding config.json and the safetensors files of model `name` inside a pod."""
    if source.hugging_face is not None:
        return hf_snapshot_dir(source.hugging_face.repo, source.hugging_face.revision, hf_root)
    if source.path is None and source.pvc is None:  # the CRD's CEL rule makes this unreachable
        raise ValueError(f"model {name!r}: source needs one of path, pvc, huggingFace")
    return model_dir(name, models_root)
