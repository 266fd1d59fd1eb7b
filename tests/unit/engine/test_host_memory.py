"""engine/host_memory.py: with the engine's malloc setting a large tensor comes from the heap (reused
after free) rather than a fresh mmap; an operator's own malloc settings are left alone. Each case runs
in a fresh process, since the setting is process-wide and glibc reports its mmapped bytes (mallinfo2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

LARGE = 64 << 20  # above glibc's default mmap threshold (at most 32 MiB)
PROBE = f"""
import ctypes, json, sys
import torch
from keepwarm_runtime.engine.host_memory import keep_freed_memory

applied = keep_freed_memory() if sys.argv[1] == "engine" else None
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
before = libc.mallinfo2().hblkhd
tensor = torch.empty({LARGE}, dtype=torch.uint8)
print(json.dumps({{"applied": applied, "mmapped": libc.mallinfo2().hblkhd - before}}))
"""
USER_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


def probe(mode: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in USER_VARS}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, mode], env=clean | env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_large_tensor_comes_from_the_heap_with_the_engine_setting_and_from_mmap_without():
    assert probe("engine") == {"applied": True, "mmapped": 0}
    assert probe("default")["mmapped"] >= LARGE  # glibc's default: a fresh mapping, unmapped on free


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_an_operators_malloc_setting_wins():
    got = probe("engine", MALLOC_MMAP_THRESHOLD_=str(1 << 20))
    assert got["applied"] is False and got["mmapped"] >= LARGE
