"""Where a model's files appear inside agent and runtime pods.

Runtime pods get their one model's path or pvc source mounted at `<MODELS_ROOT>/<model name>`. Agent
pods must not change when models do, so they mount the WeightCache's modelDirectory once at
HOST_MODELS_MOUNT and find a path source under it (host_model_dir); pvc sources stay per-model mounts
at `<MODELS_ROOT>/<model name>` in both. Both mount the node's download directory at HF_MOUNT. The
fingerprint does not depend on the directory, so the agent's copy is the one a runtime pod asks for.
On host-tier nodes the agent pod also builds the CPU attention kernel into the node's kernel folder
(kernel_cache_dir), which CPU runtime pods mount read-only at KERNELS_MOUNT.
LoRA adapters on a pvc are mounted at `<LORA_ROOT>/<adapter name>` in runtime pods. A WeightCache
model's adapters (spec.models[].adapters) on a pvc are mounted in agent pods at
`<CACHED_ADAPTERS_ROOT>/<model>/<adapter>` (cached_adapter_dir); their path sources lie under the
modelDirectory mount like models' (host_model_dir), and Hub sources under the download mount. Runtime
pods that serve LoRA adapters from a WeightCache mount its modelDirectory and download directory the same
way, so an adapter added to their list needs no new volume; the list itself is a ConfigMap's file at
LORA_LIST_MOUNT/LORA_LIST_FILE, which the runtime re-reads when the kubelet updates it.
With snapshots enabled, agent pods mount the cache's snapshot store (snapshot_store_dir) at
SNAPSHOTS_MOUNT to write it, and runtime pods whose startup mode is Snapshot mount it there read-only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # standard library only at run time: the cache daemon's settings take defaults here
    from .common import ModelSource

MODELS_ROOT = "/models"  # path and pvc sources, one directory per model name
HF_MOUNT = "/var/cache/keepwarm"  # the node's download directory (WeightCache spec.downloadDirectory)
LORA_ROOT = "/lora"  # LoRA adapters on a pvc, one directory per adapter name
HOST_MODELS_MOUNT = "/host-models"  # the WeightCache's modelDirectory in agent and LoRA pods (read-only)
LORA_LIST_MOUNT = "/etc/keepwarm/lora"  # runtime pods: the ConfigMap listing the LoRA adapters they serve
LORA_LIST_FILE = "adapters.json"  # its one key (serveflags.lora_modules_file writes it)
CACHED_ADAPTERS_ROOT = "/adapters"  # a WeightCache model's pvc adapters in agent pods, <model>/<adapter>
KERNELS_MOUNT = "/var/lib/keepwarm/kernels"  # the node's CPU kernel builds (kernel_cache_dir) in pods
SNAPSHOTS_MOUNT = "/var/lib/keepwarm/snapshots"  # the node's snapshot store (snapshot_store_dir) in pods


class PathOutsideModelDirectory(ValueError):
    """A path source outside the WeightCache's modelDirectory (the CRD's CEL rule refuses these)."""


def host_model_dir(path: str, model_directory: str, mount: str = HOST_MODELS_MOUNT) -> str:
    """Where the path source `path` (a directory on the node under `model_directory`) is in an agent."""
    prefix = model_directory.rstrip("/") + "/"
    if not path.startswith(prefix):
        raise PathOutsideModelDirectory(f"source.path {path} is not under modelDirectory {model_directory}")
    return f"{mount.rstrip('/')}/{path[len(prefix) :].strip('/')}"


def kernel_cache_dir(download_directory: str) -> str:
    """The node's folder of CPU kernel builds: under the WeightCache's download directory (a cache
    that outlives pods), written only by the agent pod, read-only in runtime pods."""
    return f"{download_directory.rstrip('/')}/kernels"


def snapshot_store_dir(directory: str, cache: str) -> str:
    """A WeightCache's snapshot store on a node: written only by its agent pods, read-only in
    runtime pods (WeightCache spec.snapshots.directory, one folder per cache)."""
    return f"{directory.rstrip('/')}/{cache}"


def model_dir(name: str, root: str = MODELS_ROOT) -> str:
    """The directory a path or pvc source of model `name` is mounted at."""
    return f"{root}/{name}"


def lora_dir(name: str, root: str = LORA_ROOT) -> str:
    """The directory a pvc source of LoRA adapter `name` is mounted at."""
    return f"{root}/{name}"


def cached_adapter_dir(model: str, adapter: str, root: str = CACHED_ADAPTERS_ROOT) -> str:
    """The directory a pvc source of adapter `adapter` of WeightCache model `model` is mounted at in
    agent pods (names are DNS labels, so the two levels never collide)."""
    return f"{root}/{model}/{adapter}"


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
