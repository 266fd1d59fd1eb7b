"""glibc's malloc for a CPU engine: large freed blocks stay in the heap for reuse, not unmapped.

A CPU decode step allocates and frees tens of MB per layer (each sequence's gathered keys and values,
padded query grids, masks). glibc serves every block above its mmap threshold (dynamic, at most 32 MiB
by default) with a fresh ``mmap`` and unmaps it on free, so each step's big tensors fault in every
page again, on every layer. Measured on this project's 2-core VM: a 50 MB bf16 KV gather (64
sequences x 1536 keys) took 246 ms into fresh mappings and 52 ms into reused heap memory, and the
gather was 64% of a long-context decode step (py-spy). Raising the mmap and trim thresholds once per
process keeps those blocks in the heap; the price is that the process keeps its peak heap instead
of returning it to the kernel, which a server holding its KV cache does anyway.

An operator's own choice wins: with ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_`` or
``GLIBC_TUNABLES`` set, or outside glibc (musl, or no libc.so.6), nothing is changed.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Mapping

log = logging.getLogger(__name__)

# mallopt parameter numbers (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30  # blocks below 1 GiB come from (and return to) the heap
TRIM_THRESHOLD = (1 << 31) - 1  # free heap top kept up to 2 GiB (the largest int mallopt takes)
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")

_applied: bool | None = None  # once per process: None until tried


def keep_freed_memory(environ: Mapping[str, str] = os.environ, libc_name: str = "libc.so.6") -> bool:
    """Raise glibc's mmap and trim thresholds (once per process); True when they are raised."""
    global _applied
    if _applied is not None:
        return _applied
    user = [name for name in USER_SETTINGS if environ.get(name)]
    if user:
        log.info("host memory: malloc left as %s set it", ", ".join(user))
        _applied = False
        return False
    try:
        mallopt = ctypes.CDLL(libc_name).mallopt
    except (OSError, AttributeError) as exc:
        log.info("host memory: malloc left as is (no glibc mallopt: %s)", exc)
        _applied = False
        return False
    _applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    log.info(
        "host memory: freed blocks under %d MiB are kept for reuse (glibc mmap threshold)%s",
        MMAP_THRESHOLD >> 20,
        "" if _applied else "; glibc refused the setting",
    )
    return _applied
