"""Daemon snapshots (keepwarm_runtime.cache.snapshot) built by hand, for tests of the node agent's
status and for the benchmark's stand-in daemon: what a real daemon would report holding, without
loading anything. Only the fields a test names differ from a plain host-tier daemon's."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from keepwarm_api.refusals import Refusals
from keepwarm_api.sockets import HOST_SOCKET, gpu_socket_name
from keepwarm_runtime import __version__
from keepwarm_runtime.cache.adapters import KIND_MODEL
from keepwarm_runtime.cache.fingerprint import WeightCacheKey
from keepwarm_runtime.cache.snapshot import DaemonSnapshot, ModelSnapshot


def model_key(name: str) -> WeightCacheKey:
    """A key of its own for model `name` (its checkpoint and files hashes are the name)."""
    return WeightCacheKey(
        checkpoint=name,
        files=name,
        architecture="LlamaForCausalLM",
        dtype="bfloat16",
        quantization="none",
        conversion="model",
        revision="local",
        tp_rank=0,
        tp_size=1,
        version=__version__,
    )


def resident(
    name: str,
    nbytes: int,
    *,
    pinned: bool = False,
    gpu_uuids: tuple[str, ...] = (),
    kind: str = KIND_MODEL,
) -> ModelSnapshot:
    """Model (or adapter) `name` resident in `nbytes`, loaded from /models/<name>."""
    return ModelSnapshot(
        path=Path("/models") / name,
        nbytes=nbytes,
        key=model_key(name),
        digest=f"sha256-of-{name}",
        pinned=pinned,
        tier="host",
        gpu_uuids=gpu_uuids,
        num_tensors=1,
        load_seconds=0.0,
        hits=0,
        page_mode="4k",
        kind=kind,
    )


def daemon_snapshot(
    models: Mapping[str, ModelSnapshot] | None = None,
    *,
    gpu_uuid: str | None = None,
    refusals: Refusals | None = None,
) -> DaemonSnapshot:
    """A daemon holding `models` (daemon name -> entry): the host tier's, or with `gpu_uuid` the gpu-tier
    daemon of that GPU."""
    return DaemonSnapshot(
        version=__version__,
        pid=os.getpid(),
        tier="gpu" if gpu_uuid else "host",
        socket=Path("/var/run/keepwarm/test") / (gpu_socket_name(gpu_uuid) if gpu_uuid else HOST_SOCKET),
        dtype="bfloat16",
        budget=None,
        gpu_uuid=gpu_uuid,
        serves_gpu=gpu_uuid,
        models=dict(models or {}),
        failed={},
        refusals=refusals,
    )
