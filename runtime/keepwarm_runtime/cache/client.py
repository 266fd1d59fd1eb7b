"""Client side of the cache: ``attach()`` named tensors from the node's daemon, or from disk.

An inference process calls ``attach(model_dir, socket_dir)`` once at start (and ``attach_adapter`` for
each LoRA adapter it registers). On a hit it gets
zero-copy views of the daemon's arena (read-only memory: never write into them); on any miss or
error it falls back to a plain safetensors load when ``fallback`` is true, logging each distinct
reason once and counting every fallback in ``keepwarm_cache_client_misses_total``.

Nothing here reads the environment: the caller passes the socket directory, mode, fallback and the
extra uids it trusts to own the socket, as its settings resolved them (`keepwarm serve`: EngineConfig's
cache fields). A process without settings of its own reads the KEEPWARM_CACHE_* variables with
``cache.env.cache_client_settings()``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from keepwarm_api.sockets import HOST_SOCKET, gpu_socket_name
from keepwarm_api.values import CacheMode, Tier
from keepwarm_runtime import __version__
from keepwarm_runtime.cache import protocol, security
from keepwarm_runtime.cache.adapters import adapter_key, read_adapter
from keepwarm_runtime.cache.fingerprint import WeightCacheKey, compute_key, files_hash
from keepwarm_runtime.cache.metrics import client_metrics
from keepwarm_runtime.log_once import warning_once
from keepwarm_runtime.weights.arena import TensorEntry, load_from_disk, load_serving_layout
from keepwarm_runtime.weights.checkpoint import parse_dtype, read_checkpoint
from keepwarm_runtime.weights.kernel_layout import MODEL, conversion_id
from keepwarm_runtime.weights.quantization import Fp8Settings
from keepwarm_runtime.weights.tensor_parallel import WHOLE, Sharding

log = logging.getLogger(__name__)
_RETRY_ERRNOS = {errno.EAGAIN, errno.ECONNREFUSED}
PAGE_MODES = frozenset({"4k", "thp", "hugetlb", "vmm"})  # what a daemon's arenas may report


@dataclass
class AttachResult:
    tensors: dict[str, torch.Tensor]  # checkpoint name -> tensor in `dtype` on `device`
    aliases: dict[str, str]  # extra name -> name in tensors (tied weights)
    source: str  # "cache" | "disk"
    reason: str | None  # why it fell back: "absent", "mismatch: dtype", "unavailable: ..." or None
    seconds: float  # wall time of attach or load
    model: str | None = None  # daemon's model name on a hit
    tier: str | None = None  # "host" | "gpu" on a hit
    digest: str | None = None  # content digest the daemon computed while loading
    page_mode: str | None = None  # arena pages on a hit: "4k" | "thp" | "hugetlb" | "vmm"
    gpu_uuid: str | None = None  # gpu tier: the GPU holding the arena (checked against `device`)
    # the checkpoint's file identities the tensors came from (fingerprint.files_hash): ranks of one
    # group compare it, so a group never serves shards of two checkpoints
    files: str | None = None


class CacheAttachError(Exception):
    """The cache could not serve the model and fallback is off; ``reason`` is the short form."""

    def __init__(self, reason: str, message: str | None = None) -> None:
        super().__init__(message or reason)
        self.reason = reason


def attach(
    model_dir: str | Path,
    socket_dir: str | Path | None,
    *,
    dtype: torch.dtype | str = torch.bfloat16,
    device: str | torch.device = "cpu",
    mode: str = CacheMode.ZERO_COPY.value,
    fallback: bool = True,
    timeout_s: float = 5.0,
    sharding: Sharding = WHOLE,
    online: Fp8Settings | None = None,
    expert_layout: str = MODEL,
    trusted_uids: frozenset[int] = frozenset(),
) -> AttachResult:
    """Named tensors of ``model_dir`` in ``dtype`` on ``device``: from the cache or from disk.

    Either way the tensors are in the serving layout (weights/arena.py ``plan_layout``: experts merged,
    the arena's names): the disk path fills a private arena from the daemon's own plan. ``online``
    (FP8 settings of ``--quantization fp8``) asks for e4m3 weights plus ``_scale_inv`` block scales,
    quantized at load; ``expert_layout`` (a name of ``weights.kernel_layout.LAYOUTS``; unknown
    names raise) for experts converted to that MoE kernel's layout; a daemon holding another
    conversion is a miss ("mismatch: conversion"), and the disk path converts as the daemon would.

    ``sharding``: one tensor-parallel rank's slice of every tensor (weights.tensor_parallel), keyed by
    its rank and size, so a daemon holding another rank's shard is a miss naming ``tp_rank``.

    ``socket_dir=None`` loads from disk. ``mode="copy"`` copies out of the arena into private memory.
    ``trusted_uids``: uids besides this process's and root's that may own the socket and its daemon.
    Raises CacheAttachError when the cache fails and ``fallback`` is off. The environment is not read
    here (``cache.env.cache_client_settings()`` reads it for callers without settings).
    """
    started = time.perf_counter()
    if mode not in tuple(CacheMode):
        raise ValueError(f"unknown cache mode {mode!r}; use {' or '.join(CacheMode)}")
    dtype, device = parse_dtype(dtype), torch.device(device)
    conversion = conversion_id(expert_layout, sharding)  # an unknown layout is refused before any I/O
    model_dir = Path(model_dir)
    shards = read_checkpoint(model_dir)
    metrics = client_metrics()
    reason = None
    if socket_dir is not None:

        def key() -> WeightCacheKey:
            return compute_key(
                model_dir,
                dtype,
                sharding.rank,
                sharding.size,
                shards=shards,
                conversion=conversion,
                online=online,
            )

        try:
            result = _attach_from_cache(
                key, model_dir, Path(socket_dir), device, mode, timeout_s, trusted_uids
            )
            result.seconds = time.perf_counter() - started
            result.files = files_hash(shards)
            metrics.hits.inc()
            metrics.attach_seconds.labels("cache").observe(result.seconds)
            return result
        except CacheAttachError as exc:
            if not fallback:
                raise
            reason = exc.reason
            metrics.misses.labels(reason.split(":")[0]).inc()
            warning_once(log, reason, "weight cache miss for %s (%s); loading from disk", model_dir, exc)
    tensors = load_serving_layout(shards, dtype, device, online, expert_layout, sharding)
    seconds = time.perf_counter() - started
    metrics.attach_seconds.labels("disk").observe(seconds)
    return AttachResult(tensors, {}, "disk", reason, seconds, files=files_hash(shards))


def attach_adapter(
    directory: str | Path,
    socket_dir: str | Path | None,
    *,
    dtype: torch.dtype | str,
    device: str | torch.device = "cpu",
    mode: str = CacheMode.ZERO_COPY.value,
    fallback: bool = True,
    timeout_s: float = 5.0,
    trusted_uids: frozenset[int] = frozenset(),
) -> AttachResult:
    """A LoRA adapter's tensors (cache/adapters.py): attached from the node cache, else from disk.

    Like ``attach``, but keyed and laid out as an adapter (no model conversion applies). The arena
    of a host-tier daemon is mapped on the host, whatever ``device`` is: registered adapters stay
    on the host and their slots copy them to the device (engine/lora/slots.py); a gpu-tier arena
    stays on its GPU. The disk path reads to the host. ``socket_dir=None`` reads from disk. The
    caller logs ``reason`` (it knows the adapter's name); the model's client metrics are untouched.
    CheckpointError (a missing or malformed file) is raised before the cache is asked.
    """
    started = time.perf_counter()
    if mode not in tuple(CacheMode):
        raise ValueError(f"unknown cache mode {mode!r}; use {' or '.join(CacheMode)}")
    dtype, device, directory = parse_dtype(dtype), torch.device(device), Path(directory)
    shards = read_adapter(directory)
    reason = None
    if socket_dir is not None:
        socket = socket_path_for(Path(socket_dir), device)
        on = device if socket.name != HOST_SOCKET else torch.device("cpu")

        def key() -> WeightCacheKey:
            return adapter_key(directory, dtype, shards)

        try:
            result = _attach_from_cache(key, directory, Path(socket_dir), on, mode, timeout_s, trusted_uids)
            result.seconds = time.perf_counter() - started
            return result
        except CacheAttachError as exc:
            if not fallback:
                raise
            reason = exc.reason
    tensors = load_from_disk(shards, dtype, "cpu")
    return AttachResult(tensors, {}, "disk", reason, time.perf_counter() - started)


def socket_path_for(socket_dir: Path, device: torch.device) -> Path:
    """gpu-<UUID>.sock for a CUDA device when that daemon exists, else host.sock."""
    if device.type == "cuda":
        from keepwarm_runtime.cache.backends import cuda

        gpu = socket_dir / gpu_socket_name(cuda.gpu_uuid(device.index or 0))
        if gpu.exists():
            return gpu
    return socket_dir / HOST_SOCKET


def request(sock: socket.socket, header: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
    """One request/reply round trip; a daemon error reply raises CacheAttachError."""
    # The daemon may have answered (e.g. "forbidden") and closed before reading: read that answer.
    with contextlib.suppress(BrokenPipeError):
        protocol.send_frame(sock, header)
    reply, fds = protocol.recv_frame(sock)
    if not reply.get("ok"):
        for fd in fds:
            os.close(fd)
        err = reply.get("error") or {}
        raise CacheAttachError(f"error: {err.get('code', '?')}", f"daemon refused: {err.get('message')}")
    return reply, fds


def connect(socket_path: Path, timeout_s: float, trusted_uids: frozenset[int] = frozenset()) -> socket.socket:
    """Connect after checking the path and the daemon's credentials (owned by and running as this
    process's uid, root or one of ``trusted_uids``); errors -> CacheAttachError.

    While the socket file exists, a full listen backlog (EAGAIN) or a daemon between its bind and
    listen, or restarting (ECONNREFUSED), is retried until ``timeout_s``: a restart storm of pods
    waits for the cache instead of going cold.
    """
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while True:
        if not socket_path.exists():
            raise CacheAttachError(f"unavailable: no daemon socket at {socket_path}")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            security.check_client_path(socket_path, trusted_uids)
            sock.connect(str(socket_path))
            security.check_server_peer(sock, trusted_uids)
            sock.settimeout(timeout_s)
            return sock
        except security.CacheSecurityError as exc:
            sock.close()
            raise CacheAttachError(f"unavailable: {exc}") from None
        except OSError as exc:
            sock.close()
            if exc.errno in _RETRY_ERRNOS and time.monotonic() + delay < deadline:
                time.sleep(delay)
                delay = min(delay * 2, 0.1)
                continue
            raise CacheAttachError(f"unavailable: {exc.strerror or exc}") from None


def open_session(
    socket_path: Path, timeout_s: float, trusted_uids: frozenset[int] = frozenset()
) -> socket.socket:
    """A connection whose ``hello`` succeeded; a daemon at its connection limit ("busy") is retried
    until ``timeout_s``, like a full backlog."""
    deadline = time.monotonic() + timeout_s
    delay = 0.01
    while True:
        sock = connect(socket_path, max(deadline - time.monotonic(), 0.01), trusted_uids)
        try:
            hello, _ = request(
                sock, {"cmd": "hello", "protocol": protocol.PROTOCOL_VERSION, "version": __version__}
            )
            if hello.get("protocol") != protocol.PROTOCOL_VERSION:
                raise CacheAttachError(f"mismatch: protocol {hello.get('protocol')}")
            return sock
        except CacheAttachError as exc:
            sock.close()
            if exc.reason == "error: busy" and time.monotonic() + delay < deadline:
                time.sleep(delay)
                delay = min(delay * 2, 0.2)
                continue
            raise
        except (OSError, protocol.ProtocolError) as exc:
            sock.close()
            raise CacheAttachError(f"unavailable: {exc}") from None


def _attach_from_cache(*args) -> AttachResult:
    """Any failure of the cache path is a miss with a reason, never a crash of the client."""
    try:
        return _attach_or_raise(*args)
    except CacheAttachError:
        raise
    except Exception as exc:
        raise CacheAttachError(f"error: {type(exc).__name__}: {exc}") from exc


def _attach_or_raise(
    make_key: Callable[[], WeightCacheKey],
    model_dir: Path,
    socket_dir: Path,
    device: torch.device,
    mode: str,
    timeout_s: float,
    trusted_uids: frozenset[int],
) -> AttachResult:
    key = make_key()
    sock = open_session(socket_path_for(socket_dir, device), timeout_s, trusted_uids)
    fds: list[int] = []
    try:
        reply, fds = request(sock, {"cmd": "get_state", "key": key.to_dict(), "name": model_dir.name})
    except (OSError, protocol.ProtocolError) as exc:
        raise CacheAttachError(f"unavailable: {exc}") from None
    finally:
        sock.close()
    try:
        if reply["state"] == "absent":
            raise CacheAttachError("absent", f"no resident model matches {model_dir}")
        if reply["state"] == "mismatch":
            fields = ",".join(reply.get("fields", []))
            why = reply.get("reason") or fields
            raise CacheAttachError(
                f"mismatch: {why}", f"resident model {reply.get('model')} differs in: {fields} ({why})"
            )
        if reply["state"] != "hit" or len(fds) != 1:
            raise CacheAttachError("error: bad_reply", f"state {reply['state']!r} with {len(fds)} fds")
        check_hit(reply, device)
        entries = [TensorEntry.from_wire(row) for row in reply["tensors"]]
        check_layout(entries, int(reply["size"]))
        aliases = check_aliases(reply.get("aliases", {}), {e.name for e in entries})
        tensors = _map_tensors(reply, fds[0], entries, device, mode)
    finally:
        for fd in fds:
            os.close(fd)
    return AttachResult(
        tensors,
        aliases,
        "cache",
        None,
        0.0,
        model=reply.get("model"),
        tier=reply.get("tier"),
        digest=reply.get("digest"),
        page_mode=reply["page_mode"],
        gpu_uuid=reply.get("gpu_uuid"),
    )


def _bad_reply(message: str) -> CacheAttachError:
    return CacheAttachError("error: bad_reply", f"daemon reply refused: {message}")


def check_hit(reply: dict[str, Any], device: torch.device) -> None:
    """Honour or refuse, by name, every field of a hit that is not the tensor table."""
    tier, page_mode, gpu = reply.get("tier"), reply.get("page_mode"), reply.get("gpu_uuid")
    if tier not in tuple(Tier):
        raise _bad_reply(f"unknown tier {tier!r}")
    if page_mode not in PAGE_MODES:
        raise _bad_reply(f"unknown page_mode {page_mode!r}")
    if tier == "host" and gpu is not None:
        raise _bad_reply(f"a host-tier arena names gpu_uuid {gpu!r}")
    if tier == "gpu":
        if device.type != "cuda":
            raise CacheAttachError("mismatch: tier", "the gpu tier serves CUDA devices only")
        from keepwarm_runtime.cache.backends import cuda

        mine = cuda.gpu_uuid(device.index or 0)
        if gpu != mine:
            raise CacheAttachError("mismatch: gpu_uuid", f"arena lives on {gpu}, this process uses {mine}")


def check_layout(entries: list[TensorEntry], size: int) -> None:
    """Every tensor lies inside the arena and its bytes match its shape."""
    for e in entries:
        count = e.dtype.itemsize
        for d in e.shape:
            count *= d
        if e.offset < 0 or e.nbytes != count or e.offset + e.nbytes > size:
            raise _bad_reply(f"tensor {e.name!r} does not fit the {size}-byte arena")


def check_aliases(aliases: Any, names: set[str]) -> dict[str, str]:
    """Aliases (tied weights) must map names to tensors of the reply."""
    if not isinstance(aliases, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and v in names for k, v in aliases.items()
    ):
        raise _bad_reply("aliases must map names to tensors of the reply")
    return dict(aliases)


def _map_tensors(
    reply: dict[str, Any], fd: int, entries: list[TensorEntry], device: torch.device, mode: str
) -> dict[str, torch.Tensor]:
    size = int(reply["size"])
    if reply["tier"] == "gpu":
        from keepwarm_runtime.cache.backends.cuda import import_arena

        mapping = import_arena(fd, size, device.index or 0)
        tensors = {e.name: mapping.tensor(e.offset, e.dtype, e.shape) for e in entries}
        return {n: t.clone() for n, t in tensors.items()} if mode == CacheMode.COPY else tensors

    from keepwarm_runtime.cache.backends.host import map_readonly, readonly_tensor

    buf = map_readonly(fd, size)
    arena = readonly_tensor(buf, 0, torch.uint8, (size,))  # one buffer export; it keeps the mapping
    if mode == CacheMode.COPY or device.type != "cpu":
        # One bulk copy out of the arena, then views of the private copy (moved to `device`).
        private = torch.empty(size, dtype=torch.uint8)
        private.copy_(arena)
        del arena  # releases the buffer export so the mapping can close
        buf.close()
        return _views(private.to(device), entries)
    return _views(arena, entries)  # slices of one tensor: far cheaper than a buffer export per tensor


def _views(arena: torch.Tensor, entries: list[TensorEntry]) -> dict[str, torch.Tensor]:
    """Each entry's tensor as a view of the flat uint8 ``arena`` (offsets are aligned to its dtype)."""
    return {e.name: arena[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in entries}
