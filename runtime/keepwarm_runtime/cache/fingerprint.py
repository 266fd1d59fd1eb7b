"""`WeightCacheKey`: what must be equal for a client to use weights the daemon holds.

Two hashes identify the checkpoint, both cheap to compute (a few small reads and one ``fstat`` per
shard, never the weight bytes, so a restart costs O(shards) system calls):

* ``checkpoint`` covers every shard's name, size and safetensors header: *which* tensors, laid out how.
* ``files`` covers every shard's file identity (device, inode, size, mtime_ns, ctime_ns): *which*
  files, unchanged since. Two checkpoints with equal headers (fine-tunes of one base model, or
  ``make-model --seed 1`` and ``--seed 2``) differ here, and so does a shard rewritten in place.

The daemon separately records a content digest while it reads the bytes (``loader.fill_arena``) and
re-checks file identities before each hit, so a shard changed on disk after load is a miss.
``conversion`` names the serving layout the daemon wrote into the arena (expert merges, FP8 scales
kept in float32: ``weights.serving_layout.CONVERSION_ID``), plus the MoE kernel's expert layout
when one was asked for (``weights.kernel_layout.conversion_id``); a new layout version is a miss.
``quantization`` is the checkpoint's own ``quantization_config`` (hashed), or for online FP8
(``--quantization fp8``) the settings and quantizer version (``Fp8Settings.key_text``): a client that
asks for online FP8 never attaches float weights, nor a float client FP8 ones.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from keepwarm_runtime import __version__
from keepwarm_runtime.weights.files import ShardFile, read_config, read_shard_files
from keepwarm_runtime.weights.layouts import CONVERSION_ID
from keepwarm_runtime.weights.quantization import Fp8Settings
from keepwarm_runtime.weights.tensor_parallel import SHARDING_ID, Sharding

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class WeightCacheKey:
    checkpoint: str  # sha256 over shard names, sizes and safetensors headers
    files: str  # sha256 over shard names and file identities (device, inode, size, mtime, ctime)
    architecture: str  # config.json architectures[0] (or model_type)
    dtype: str  # serving dtype of floating tensors, e.g. "float32"
    quantization: str  # sha256 of config.json quantization_config, online settings, or "none"
    conversion: str  # the arena's serving layout (+ expert layout): weights.kernel_layout.conversion_id
    revision: str  # hub commit (HF cache snapshot dir / _commit_hash) or "local"
    tp_rank: int  # tensor-parallel rank this entry serves
    tp_size: int  # tensor-parallel world size
    version: str  # keepwarm version (arena layout may change between versions)

    def diff(self, other: WeightCacheKey) -> list[str]:
        """Names of the fields that differ, in declaration order."""
        return [f.name for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> WeightCacheKey:
        """Parse a key from the wire; every field must be present with its declared type."""
        if not isinstance(data, dict):
            raise ValueError("fingerprint must be a JSON object")
        missing = {f.name for f in fields(cls)} - set(data)
        if missing:
            raise ValueError(f"fingerprint lacks fields: {', '.join(sorted(missing))}")
        for f in fields(cls):
            value, kind = data[f.name], int if f.type == "int" else str
            if type(value) is not kind or (kind is str and len(value) > 256):
                raise ValueError(f"fingerprint field {f.name} must be a {kind.__name__}")
        return cls(**{f.name: data[f.name] for f in fields(cls)})

    @property
    def sharding(self) -> Sharding:
        """The tensor-parallel shard this key names (expert parallel is in its ``conversion``)."""
        expert = SHARDING_ID + "-ep" in self.conversion.split("+")
        return Sharding(self.tp_rank, self.tp_size, expert and self.tp_size > 1)

    @property
    def digest(self) -> str:
        """Short stable id of the whole key, for logs and status."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def checkpoint_hash(shards: list[ShardFile]) -> str:
    h = hashlib.sha256()
    for shard in shards:
        h.update(f"{shard.path.name}\0{shard.size}\0{len(shard.header)}\0".encode())
        h.update(shard.header)
    return h.hexdigest()


def files_hash(shards: list[ShardFile]) -> str:
    h = hashlib.sha256()
    for shard in shards:
        h.update(f"{shard.path.name}\0{shard.identity.as_tuple()}\0".encode())
    return h.hexdigest()


def _revision(model_dir: Path, config: dict[str, Any]) -> str:
    resolved = model_dir.resolve()
    if resolved.parent.name == "snapshots":  # huggingface_hub cache layout: snapshots/<commit>/
        return resolved.name
    return str(config.get("_commit_hash") or "local")


def _name(dtype: torch.dtype) -> str:
    from keepwarm_runtime.weights.checkpoint import dtype_name  # a torch dtype: torch is loaded already

    return dtype_name(dtype)


def compute_key(
    model_dir: str | Path,
    dtype: torch.dtype | str,
    tp_rank: int = 0,
    tp_size: int = 1,
    shards: list[ShardFile] | None = None,
    conversion: str = CONVERSION_ID,
    online: Fp8Settings | None = None,
) -> WeightCacheKey:
    """Key of ``model_dir`` served in ``dtype`` (quantized at load when ``online`` is given); reads
    only headers, ``fstat`` and config.json, and needs no torch when ``dtype`` is a name."""
    model_dir = Path(model_dir)
    shards = shards if shards is not None else read_shard_files(model_dir)
    config = read_config(model_dir)
    archs = config.get("architectures") or [config.get("model_type", "unknown")]
    quant = config.get("quantization_config")
    quant_hash = (
        hashlib.sha256(json.dumps(quant, sort_keys=True).encode()).hexdigest()[:16] if quant else "none"
    )
    if online is not None:
        quant_hash = online.key_text() if not quant else f"{quant_hash}+{online.key_text()}"
    return WeightCacheKey(
        checkpoint=checkpoint_hash(shards),
        files=files_hash(shards),
        architecture=str(archs[0]),
        dtype=dtype if isinstance(dtype, str) else _name(dtype),
        quantization=quant_hash,
        conversion=conversion,
        revision=_revision(model_dir, config),
        tp_rank=tp_rank,
        tp_size=tp_size,
        version=__version__,
    )
