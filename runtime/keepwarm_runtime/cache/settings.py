"""`keepwarm cache serve`'s settings, declared once (keepwarm_api.settings generates its flags,
KEEPWARM_CACHE_* variables and --help from this class, and scripts/flag_tables.py the table in
docs/reference/flags.md).

Every setting is ``--flag`` and ``KEEPWARM_CACHE_<FIELD>`` (``--budget`` <- ``KEEPWARM_CACHE_BUDGET``),
except the node agent's node name and namespace, which agent pods get as ``NODE_NAME`` and
``POD_NAMESPACE`` from the downward API, and its roots, which keep their ``KEEPWARM_*_ROOT`` names
(keepwarm_api.podenv); repeatable flags
(``--model``, ``--adapter``, ``--pin``, ``--allow-uid``, ``--allow-gid``, ``--fake-gpu``) take comma-separated
variables. Fields that DaemonConfig also has carry over to it by name
(``keepwarm_api.settings.carry_over``); ``--all-gpus`` and ``--fake-gpu`` choose how many daemons run
(cache/gpus.py). The node agent's flags (``--max-loads``, ``--stall-timeout``, ``--namespace``) take
their defaults from the agent's own constants (agent/settings.py), its roots from keepwarm_api.paths.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import ClassVar

from keepwarm_api import podenv
from keepwarm_api.paths import HF_MOUNT, HOST_MODELS_MOUNT, MODELS_ROOT
from keepwarm_api.settings import setting
from keepwarm_api.values import SERVING_DTYPES, DType, Quantization, Tier
from keepwarm_runtime.agent.settings import MAX_LOADS, NAMESPACE, STALL_TIMEOUT_S
from keepwarm_runtime.cache.gpus import fake_gpu_uuid
from keepwarm_runtime.weights.layouts import LAYOUTS, MODEL

TIERS = ("auto", *(t.value for t in Tier))  # auto: gpu when CUDA is present
QUANTIZATIONS = tuple(q.value for q in Quantization)
AFTER_HANDOFF = ("exit", "wait")  # what a daemon (or holder) does once a successor took over
AFTER_HANDOFF_HELP = (
    "once a successor took over: exit, or wait idle for SIGTERM (in a pod, so that the kubelet does "
    "not restart it to take everything back)"
)
_BYTE_UNITS = {
    "": 1,
    "B": 1,
    "K": 1 << 10,
    "KIB": 1 << 10,
    "M": 1 << 20,
    "MIB": 1 << 20,
    "G": 1 << 30,
    "GIB": 1 << 30,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
}


def parse_bytes(text: str) -> int:
    """A byte count such as 4GiB, 512MiB, 1e9 or 4096."""
    t = text.strip().upper()
    num = t.rstrip("KMGIB")
    try:
        value = float(num) * _BYTE_UNITS[t[len(num) :]]
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"cannot parse byte count {text!r}; use e.g. 4GiB") from None
    if not math.isfinite(value) or value < 1 or value > 2**63:
        raise argparse.ArgumentTypeError(f"byte count {text!r} must be a finite, positive size, e.g. 4GiB")
    return int(value)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


@dataclass(frozen=True)
class CacheServeSettings:
    ENV_PREFIX: ClassVar[str] = "KEEPWARM_CACHE_"

    model: tuple[str, ...] = setting((), "checkpoint directory to load at start", metavar="DIR")
    adapters: tuple[str, ...] = setting(
        (),
        "PEFT LoRA adapter directory to load at start, as stored (no --quantization or --expert-layout)",
        flag="--adapter",
        metavar="DIR",
    )
    socket_dir: str | None = setting(
        None, "socket directory, e.g. /var/run/keepwarm/WEIGHTCACHE", required=True
    )
    tier: str = setting(
        "auto", "gpu (CUDA VMM) or host (shared memory); auto: gpu when CUDA is present", choices=TIERS
    )
    device: str = setting("cuda:0", "gpu tier: which GPU")
    all_gpus: bool = setting(
        False, "gpu tier: one daemon per GPU this process sees, each on gpu-<UUID>.sock (not only --device)"
    )
    fake_gpus: tuple[str, ...] = setting(
        (),
        "test/dev only: a fake GPU; one host-memory daemon per UUID on gpu-<UUID>.sock, as --all-gpus "
        "would run per real GPU (refused with --tier host)",
        flag="--fake-gpu",
        metavar="UUID",
        parse=fake_gpu_uuid,
    )
    dtype: str = setting(
        DType.BFLOAT16.value,
        "serving dtype of floating tensors (clients must ask for the same)",
        choices=SERVING_DTYPES,
    )
    quantization: str = setting(
        "none",
        "fp8: quantize each float --model in 128x128 blocks once, at load, into the arena "
        "(clients asking for fp8 attach it; part of the cache key)",
        choices=QUANTIZATIONS,
    )
    expert_layout: str = setting(
        MODEL,
        "MoE experts in this kernel's layout, converted once at load into the arena (clients asking "
        "for the same attach it; part of the cache key)",
        choices=LAYOUTS,
    )
    tensor_parallel_size: int = setting(
        1,
        "hold each --model as this many tensor-parallel shards, one arena each: every shard in the "
        "host tier's daemon; on the gpu tier the i-th GPU's daemon holds shard i mod N",
        parse=positive_int,
    )
    enable_expert_parallel: bool = setting(
        False, "with --tensor-parallel-size: MoE experts partitioned over the shards (as the pods ask)"
    )
    budget: int | None = setting(
        None, "bytes (or 4GiB, 512MiB) per daemon (per GPU); least recently used beyond", parse=parse_bytes
    )
    pins: frozenset[str] = setting(frozenset(), "never evict this model", flag="--pin", metavar="NAME")
    group: str | None = setting(None, "share the socket with this group (0770/0660)")
    allow_uids: frozenset[int] = setting(frozenset(), "peer uid to allow", flag="--allow-uid", metavar="UID")
    allow_gids: frozenset[int] = setting(frozenset(), "peer gid to allow", flag="--allow-gid", metavar="GID")
    metrics_port: int | None = setting(None, "serve Prometheus /metrics on this port", unset="off")
    max_connections: int | None = setting(
        None,
        "open client connections, in all",
        parse=positive_int,
        unset="256, fewer under a low open-files limit",
    )
    max_connections_per_uid: int = setting(32, "open client connections per uid", parse=positive_int)
    request_deadline: float = setting(
        10.0,
        "seconds a whole request frame may take from its first byte",
        parse=positive_seconds,
        metavar="SECONDS",
    )
    after_handoff: str = setting("exit", AFTER_HANDOFF_HELP, choices=AFTER_HANDOFF)
    report_to_kubernetes: bool = setting(
        False, "run the node agent: follow this node's WeightCacheNode spec, report into its status"
    )
    weightcache: str | None = setting(None, "WeightCache name (with --report-to-kubernetes)")
    node_name: str | None = setting(
        None, "this node's name (with --report-to-kubernetes)", env=podenv.NODE_NAME
    )
    max_loads: int = setting(
        MAX_LOADS, "node agent: downloads/loads in flight at once", parse=positive_int, metavar="N"
    )
    stall_timeout: float = setting(
        STALL_TIMEOUT_S,
        "node agent: a Hub download adding no bytes for this long is stopped (and retried later)",
        parse=positive_seconds,
        metavar="SECONDS",
    )
    namespace: str = setting(
        NAMESPACE,
        "node agent: the namespace of the models' token Secrets (its pod's)",
        env=podenv.POD_NAMESPACE,
    )
    host_model_root: str = setting(
        HOST_MODELS_MOUNT,
        "node agent: where the WeightCache's modelDirectory is mounted (path sources)",
        env=podenv.HOST_MODEL_ROOT,
        metavar="DIR",
    )
    model_root: str = setting(
        MODELS_ROOT, "node agent: where pvc sources are mounted", env=podenv.MODEL_ROOT, metavar="DIR"
    )
    download_root: str = setting(
        HF_MOUNT,
        "node agent: where the node's download directory is mounted (Hugging Face downloads)",
        env=podenv.DOWNLOAD_ROOT,
        metavar="DIR",
    )
    # process snapshots of runtime pods' supervising parents (keepwarm_runtime.snapshot.service)
    snapshot_store: str | None = setting(
        None,
        "the node's snapshot store: take snapshots of runtime pods' prepared parents on their request "
        "(snapshot.sock in --socket-dir); runtime pods mount it read-only",
        unset="no snapshot service",
        metavar="DIR",
    )
    snapshot_budget: int | None = setting(
        None,
        "bytes (or 4GiB, 512MiB) the snapshot store may hold; least recently used snapshots beyond",
        parse=parse_bytes,
        unset="the disk's",
    )
    criu: str = setting("criu", "the CRIU binary taking snapshots: a path, or a name on PATH")
    snapshot_preload_timeout: float = setting(
        600.0, "seconds a snapshot's parent may take to import before the snapshot is abandoned",
        parse=positive_seconds, metavar="SECONDS",
    )  # fmt: skip


@dataclass(frozen=True)
class CacheHoldSettings:
    """`keepwarm cache hold`: the descriptor holder beside the daemons of one socket directory."""

    ENV_PREFIX: ClassVar[str] = "KEEPWARM_CACHE_"

    socket_dir: str | None = setting(
        None, "the daemons' socket directory, e.g. /var/run/keepwarm/WEIGHTCACHE", required=True
    )
    group: str | None = setting(None, "the socket directory's group, as the daemons have it (0770)")
    after_handoff: str = setting("exit", AFTER_HANDOFF_HELP, choices=AFTER_HANDOFF)
