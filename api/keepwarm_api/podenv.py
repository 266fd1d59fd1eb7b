"""Environment variables the operator sets on pods and keepwarm processes read: one home for both.

Names follow the settings layer's one rule (``settings.env_name``): runtime pods get the variables of
`keepwarm serve`'s cache settings (``keepwarm_runtime.cache.env`` reads the same ones for a program
without settings of its own). Agent pods get `keepwarm cache serve`'s node agent settings (the roots,
NODE_NAME, POD_NAMESPACE) but no per-model variables: models and token Secret references reach the
agent through its WeightCacheNode spec. Only the settings layer reads these from the environment
(tests/unit/test_env_reads.py).
The operator's builders and the runtime import these; neither spells them.
"""

from __future__ import annotations

from .settings import env_name

CACHE_SOCKET_DIR = env_name("cache_socket_dir")  # KEEPWARM_CACHE_SOCKET_DIR: the node cache's sockets
CACHE_MODE = env_name("cache_mode")  # KEEPWARM_CACHE_MODE: zero_copy | copy
CACHE_FALLBACK = env_name("cache_fallback")  # KEEPWARM_CACHE_FALLBACK: load from disk on a cache miss
CACHE_TRUSTED_UIDS = env_name("cache_trusted_uids")  # extra uids a client trusts to own the socket
MODEL_ROOT = env_name("model_root")  # where the agent finds path/pvc sources (default keepwarm_api.paths)
NODE_NAME = "NODE_NAME"  # the downward API's node name on agent pods (Kubernetes' convention)
POD_NAMESPACE = "POD_NAMESPACE"  # the downward API's namespace on agent pods: where token Secrets live
HOST_MODEL_ROOT = env_name("host_model_root")  # where the agent sees WeightCache.spec.modelDirectory
DOWNLOAD_ROOT = env_name("download_root")  # where the agent keeps Hugging Face downloads
# KEEPWARM_KERNEL_CACHE: a read-only folder of CPU kernels the node agent built for this node
# (engine/attention/native.py loads a build from there before building one of its own)
KERNEL_CACHE = env_name("kernel_cache")
HF_ENDPOINT = "HF_ENDPOINT"  # huggingface_hub's Hub address (WeightCache spec.agent.huggingFaceEndpoint)


def env_bool(value: bool) -> str:
    """A boolean as pods get it; ``settings.parse_bool`` reads it back."""
    return "1" if value else "0"
