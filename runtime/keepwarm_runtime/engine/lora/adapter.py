"""Read and check one PEFT LoRA adapter against the loaded base, before it can touch any request.

A PEFT adapter directory holds `adapter_config.json` and `adapter_model.safetensors`, whose tensors
are named `base_model.model.<module>.lora_A.weight` ([r, in]) and `...lora_B.weight` ([out, r]).
Everything is read and checked here, on the host: a config field keepwarm does not implement, a
tensor it does not recognise, a module the base lacks or holds in another form, a shape for another
base, a rank above the configured maximum or an unreadable file raises `LoraLoadError` naming it,
and nothing is registered. What comes out is ready to be copied into a slot (engine/lora/slots.py).

The tensors come through the node cache when the engine has a cache socket (``AdapterCache``):
zero-copy views of the daemon's arena of that adapter file (cache/adapters.py: keyed by the file's
identity, so a rewritten file is a miss and never served stale), else, and whenever the daemon is
absent or cannot serve it, from disk; the log says which and why, naming the adapter, and
``LoraWeights.source`` keeps it (the server's ``keepwarm_lora_load_seconds{source}``).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from keepwarm_api.values import CacheMode
from keepwarm_runtime.cache.adapters import CONFIG_FILE, WEIGHTS_FILE
from keepwarm_runtime.engine.cpu_linear import PLAIN_LINEARS

log = logging.getLogger(__name__)
# How long an adapter's attach waits for a daemon that refuses connections (one restarting, or a dead
# one's socket file): adapters load between engine steps, so a long wait would stall every request.
CACHE_TIMEOUT_S = 1.0
PEFT_PREFIX = "base_model.model."
# Projections an adapter may target: attention and MLP, separate or fused (Phi-3's qkv_proj, gate_up_proj).
TARGETABLE = frozenset(
    {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj"}
)
# Config fields whose non-default value changes the computation in a way keepwarm does not implement.
_UNSUPPORTED = {
    "use_dora": "DoRA (weight-decomposed LoRA)",
    "modules_to_save": "modules_to_save (fully trained copies of base modules)",
    "layers_to_transform": "layers_to_transform",
    "rank_pattern": "rank_pattern (per-module ranks)",
    "alpha_pattern": "alpha_pattern (per-module alphas)",
    "target_parameters": "target_parameters (LoRA on raw parameters, e.g. MoE experts)",
    "lora_bias": "lora_bias (a bias on lora_B)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D-style weights)",
    "use_qalora": "QA-LoRA",
    "trainable_token_indices": "trainable_token_indices",
    "megatron_config": "megatron_config",
}


class LoraLoadError(ValueError):
    """The adapter cannot be applied to this base; the message names the adapter and what is wrong."""


@dataclass(frozen=True)
class AdapterCache:
    """Where adapter tensors come from: the node cache behind ``socket_dir`` (None: disk only)."""

    socket_dir: str | None = None
    mode: str = CacheMode.ZERO_COPY.value  # a CacheMode, as for the model's weights
    fallback: bool = True  # read from disk when the cache cannot serve an adapter (else refuse it)
    trusted_uids: frozenset[int] = frozenset()  # uids besides ours and root's that may own the socket


@dataclass
class LoraWeights:
    """One adapter, checked: per base module A [r, in] and B [out, r]; the update is scaling * x A^T B^T."""

    name: str
    path: str
    rank: int
    scaling: float
    # module name -> (A, B), on the host (a gpu-tier arena's stay on the engine's GPU)
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]
    source: str = "disk"  # "cache" (read-only views of the daemon's arena) | "disk"
    reason: str | None = None  # why not from the cache, when a cache was asked (client.AttachResult)
    seconds: float = 0.0  # wall time to read and check it


def scaling_of(config: dict) -> float:
    """PEFT's scaling: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora."""
    r, alpha = config["r"], config.get("lora_alpha", 8)
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def read_config(name: str, directory: Path, max_rank: int) -> dict:
    """The adapter's config, refused by name where it asks for what keepwarm does not implement."""
    try:
        config = json.loads((directory / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise LoraLoadError(f"adapter {name!r}: cannot read {directory / CONFIG_FILE}: {exc}") from exc
    if not isinstance(config, dict):
        raise LoraLoadError(f"adapter {name!r}: {CONFIG_FILE} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraLoadError(f"adapter {name!r}: peft_type {config['peft_type']!r} is not LORA")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise LoraLoadError(f"adapter {name!r}: {key} is set; keepwarm does not support {what}")
    if config.get("bias", "none") != "none":
        raise LoraLoadError(f"adapter {name!r}: bias={config['bias']!r}; keepwarm supports only bias='none'")
    r = config.get("r")
    if not isinstance(r, int) or r < 1:
        raise LoraLoadError(f"adapter {name!r}: r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise LoraLoadError(f"adapter {name!r}: rank {r} is above this engine's max_lora_rank {max_rank}")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - TARGETABLE)
        if unknown:
            raise LoraLoadError(
                f"adapter {name!r}: target_modules {unknown} are not projections keepwarm applies LoRA to "
                f"({', '.join(sorted(TARGETABLE))})"
            )
    return config


def read_tensors(
    name: str, directory: Path, dtype: torch.dtype, cache: AdapterCache, device: torch.device
) -> tuple[dict[str, torch.Tensor], str, str | None]:
    """The adapter file's tensors in ``dtype``, from the node cache or disk: (tensors, source, reason).

    ``device`` (the engine's) picks the daemon: on CUDA its GPU's gpu-tier daemon when one runs (the
    tensors then stay in that GPU's arena; untested on a GPU so far), else the host tier's, mapped on
    the host."""
    from safetensors import SafetensorError

    from keepwarm_runtime.cache.client import CacheAttachError, attach_adapter
    from keepwarm_runtime.weights.checkpoint import CheckpointError

    path = directory / WEIGHTS_FILE
    if not path.is_file():
        raise LoraLoadError(f"adapter {name!r}: {path} does not exist (only safetensors adapters are read)")
    try:
        res = attach_adapter(
            directory,
            cache.socket_dir,
            dtype=dtype,
            device=device,
            mode=cache.mode,
            fallback=cache.fallback,
            timeout_s=CACHE_TIMEOUT_S,
            trusted_uids=cache.trusted_uids,
        )
    except CacheAttachError as exc:
        raise LoraLoadError(
            f"adapter {name!r}: the node cache cannot serve {path} ({exc}) and cache fallback is off"
        ) from exc
    except (CheckpointError, SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise LoraLoadError(f"adapter {name!r}: {path} is not a readable safetensors file: {exc}") from exc
    if res.reason is not None:
        log.warning(
            "LoRA adapter %r: not from the node cache (%s); read %s from disk", name, res.reason, path
        )
    return res.tensors, res.source, res.reason


def pair_tensors(name: str, tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """`base_model.model.<module>.lora_A.weight` -> {module: {"A": .., "B": ..}}; other tensors refused."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        stem = key.removeprefix(PEFT_PREFIX)
        for part in ("A", "B"):
            suffix = f".lora_{part}.weight"
            if stem.endswith(suffix):
                pairs.setdefault(stem[: -len(suffix)], {})[part] = tensor
                break
        else:
            raise LoraLoadError(
                f"adapter {name!r}: tensor {key!r} is not a lora_A/lora_B weight; keepwarm does not apply it"
            )
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise LoraLoadError(f"adapter {name!r}: {module} has lora_{''.join(pair)} but not both A and B")
    if not pairs:
        raise LoraLoadError(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    return pairs


def check_module(name: str, modules: Mapping[str, nn.Module], module_name: str) -> nn.Linear:
    """The base's plain linear layer an adapter targets (``modules``: the base's named_modules, indexed
    once per engine); anything else refused by name."""
    short = module_name.rpartition(".")[2]
    if short not in TARGETABLE:
        raise LoraLoadError(
            f"adapter {name!r}: {module_name} is not a projection keepwarm applies LoRA to "
            f"({', '.join(sorted(TARGETABLE))})"
        )
    if ".experts." in f".{module_name}.":
        raise LoraLoadError(
            f"adapter {name!r}: {module_name} is inside MoE experts; keepwarm does not apply LoRA to experts"
        )
    module = modules.get(module_name)
    if module is None:
        raise LoraLoadError(
            f"adapter {name!r}: the base model has no module {module_name} (an adapter for another model?)"
        )
    if type(module) not in PLAIN_LINEARS:
        raise LoraLoadError(
            f"adapter {name!r}: {module_name} is a {type(module).__name__}, not a plain nn.Linear; keepwarm "
            "does not apply LoRA to it (FP8 linear layers and MoE experts are not supported)"
        )
    return module


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or infinity in ``t``: one min/max pass (NaN propagates through both), no boolean copy
    of the tensor as ``isfinite(t).all()`` makes (several times slower over a large adapter)."""
    if not t.numel():
        return True
    lo, hi = torch.aminmax(t)
    return math.isfinite(lo.item()) and math.isfinite(hi.item())


def load_adapter(
    name: str,
    path: str | Path,
    model: nn.Module,
    max_rank: int,
    dtype: torch.dtype,
    cache: AdapterCache | None = None,
    base_modules: Mapping[str, nn.Module] | None = None,
) -> LoraWeights:
    """Read (through ``cache``, if given) and check the adapter at ``path`` against ``model``
    (``base_modules``: its named_modules when the caller keeps them; a deep model has hundreds to look up);
    LoraLoadError names what is wrong."""
    started = time.perf_counter()
    directory = Path(path)
    if not directory.is_dir():
        raise LoraLoadError(f"adapter {name!r}: {directory} is not a directory")
    config = read_config(name, directory, max_rank)
    rank, scaling = config["r"], scaling_of(config)
    device = next(model.parameters()).device
    tensors, source, reason = read_tensors(name, directory, dtype, cache or AdapterCache(), device)
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    if base_modules is None:
        base_modules = dict(model.named_modules())
    for module_name, pair in sorted(pair_tensors(name, tensors).items()):
        linear = check_module(name, base_modules, module_name)
        a, b = pair["A"], pair["B"]
        want_a, want_b = (rank, linear.in_features), (linear.out_features, rank)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise LoraLoadError(
                f"adapter {name!r}: {module_name} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
                f"this base needs {want_a} and {want_b} at rank {rank} (an adapter for another base?)"
            )
        if not (all_finite(a) and all_finite(b)):
            raise LoraLoadError(f"adapter {name!r}: {module_name} holds NaN or infinite weights")
        modules[module_name] = (a.to(dtype), b.to(dtype))
    seconds = time.perf_counter() - started
    log.info(
        "LoRA adapter %r: %d modules at rank %d from %s in %.1f ms",
        name,
        len(modules),
        rank,
        source,
        seconds * 1e3,
    )
    return LoraWeights(name, str(directory), rank, scaling, modules, source, reason, seconds)
