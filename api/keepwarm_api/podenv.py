"""Environment variables the operator sets on pods and keepwarm processes read: one home for both.

Names follow the settings layer's one rule (``settings.env_name``): runtime pods get the variables of
`keepwarm serve`'s cache settings, which ``attach()`` reads too; agent pods get one Hugging Face token
variable per model. The operator's builders and the runtime import these; neither spells them.
"""

from __future__ import annotations

from .settings import env_name

CACHE_SOCKET_DIR = env_name("cache_socket_dir")  # KEEPWARM_CACHE_SOCKET_DIR: the node cache's sockets
CACHE_MODE = env_name("cache_mode")  # KEEPWARM_CACHE_MODE: zero_copy | copy
CACHE_FALLBACK = env_name("cache_fallback")  # KEEPWARM_CACHE_FALLBACK: load from disk on a cache miss
CACHE_TRUSTED_UIDS = env_name("cache_trusted_uids")  # extra uids a client trusts to own the socket
MODEL_ROOT = env_name("model_root")  # where the agent finds path/pvc sources (default keepwarm_api.paths)
NODE_NAME = "NODE_NAME"  # the downward API's node name on agent pods (Kubernetes' convention)
HF_TOKEN_PREFIX = env_name("hf_token_")


def hf_token(model: str) -> str:
    """The variable holding the Hugging Face token of ``model`` on agent pods (KEEPWARM_HF_TOKEN_<MODEL>)."""
    return HF_TOKEN_PREFIX + model.upper().replace("-", "_")


def env_bool(value: bool) -> str:
    """A boolean as pods get it; ``settings.parse_bool`` reads it back."""
    return "1" if value else "0"
