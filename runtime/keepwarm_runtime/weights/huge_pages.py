"""Huge pages for the host memory that holds weights: a client maps a cache arena with its page tables
prefaulted (MAP_POPULATE), and on 4 KiB pages that is one entry per 4 KiB at every attach and wake.

Measured on this project's 2-core VM (Xeon with AVX-512, no AMX; THP ``enabled`` = ``madvise``,
``shmem_enabled`` = ``never``): mapping a 2 GiB arena took 0.077-0.16 s on 4 KiB pages and
0.0006-0.001 s on 2 MiB pages, and the daemon's fill 0.62-0.68 s against 0.39 s. A decode step was
not faster (the 100M Qwen3, float32, batch 64: 122-126 ms either way). Two kinds of memory hold weights
on a CPU engine:

* **a cache daemon's arena** (cache/backends/host.py), a memfd every client maps. The kernel gives a
  memfd huge pages on its own only where ``shmem_enabled`` says so, and most distributions ship
  ``never``. ``madvise(MADV_COLLAPSE)`` (Linux 6.1) backs a range with huge pages whatever that
  setting says except ``deny`` (the kernel's documented exception: "madvise(..., MADV_COLLAPSE) can
  still cause transparent huge pages to be obtained even if this mode is specified everywhere"), and a
  huge page of a shmem file is a huge page of every mapping of it: ``collapse_memfd`` does it once,
  before the arena is written. A file's huge page is mapped by one entry only at an address congruent
  to its offset modulo 2 MiB, which Python's ``mmap`` does not choose (nor, under ``never``, the
  kernel): ``map_aligned`` maps at such an address, for the collapse and for every client;
* **a client's private arena** (weights/arena.py, the disk path): anonymous memory, which takes huge
  pages where THP ``enabled`` is ``madvise`` (with MADV_HUGEPAGE, as ``huge_anonymous`` asks) or
  ``always`` (a 370 MiB fill 0.12-0.14 s against 0.15 s on 4 KiB pages); ``never`` is left as the
  operator set it.

Either way a huge page is asked for, never required: where the kernel refuses, the memory is what it
was before, on 4 KiB pages."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import re
from pathlib import Path

HUGE_PAGE = 2 << 20  # x86-64's and arm64's (4 KiB granule) PMD size
# include/uapi/asm-generic/mman-common.h, Linux 6.1 (Python's mmap module does not name it)
MADV_COLLAPSE = 25
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_MAP_FAILED = ctypes.c_void_p(-1).value
# Linux on every architecture keepwarm builds for (Python 3.11's mmap module names neither)
_MAP_FIXED, _PROT_NONE = 0x10, 0


def round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def thp_mode(path: Path = _THP_ENABLED) -> str:
    """The bracketed choice of a THP sysfs setting ('always', 'madvise', 'never', ...), or 'unavailable'."""
    try:
        match = re.search(r"\[(\w[\w-]*)\]", path.read_text())
    except OSError:
        return "unavailable"
    return match.group(1) if match else "unavailable"


def huge_anonymous(size: int) -> mmap.mmap | None:
    """A private anonymous mapping of ``size`` bytes (rounded up to HUGE_PAGE) that asks for huge pages
    (MADV_HUGEPAGE), its pages backed when first written; None where THP is off (``enabled`` =
    ``never``, or no THP in this kernel). The kernel places mappings of whole huge pages at aligned
    addresses (Linux 6.7); elsewhere only the aligned 2 MiB runs inside it can be huge."""
    if thp_mode() not in ("always", "madvise"):
        return None
    mapping = mmap.mmap(-1, round_up(max(size, 1), HUGE_PAGE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # THP compiled out: still memory, on 4 KiB pages
        mapping.madvise(mmap.MADV_HUGEPAGE)
    return mapping


class AlignedMapping:
    """A shared mapping of a file's first ``length`` bytes at an address aligned to HUGE_PAGE, so each
    huge page of the file is mapped by one entry. ``array()`` views it for ``torch.frombuffer``; each
    view keeps the mapping, which is unmapped when the last of them and this object are gone, or at
    ``close()``."""

    def __init__(self, address: int, length: int, libc: ctypes.CDLL) -> None:
        self.address, self.length, self._libc = address, length, libc

    def array(self) -> ctypes.Array:
        view = (ctypes.c_char * self.length).from_address(self.address)
        view.mapping = self  # the view keeps the mapping (ctypes objects take attributes)
        return view

    def close(self) -> None:
        if self.length:
            self._libc.munmap(self.address, self.length)
            self.length = 0

    def __del__(self) -> None:
        self.close()


def map_aligned(
    fd: int, length: int, *, writable: bool = False, populate: bool = False
) -> AlignedMapping | None:
    """Map ``length`` bytes of ``fd`` (MAP_SHARED; MAP_POPULATE where ``populate``) at an address
    aligned to HUGE_PAGE; None where this libc cannot."""
    libc = _libc()
    if libc is None or length <= 0:
        return None
    # reserve one huge page more than needed, map the file over its first aligned address, and give
    # the slack on either side back
    reserved = libc.mmap(None, length + HUGE_PAGE, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if reserved in (None, _MAP_FAILED):
        return None
    start = round_up(reserved, HUGE_PAGE)
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    flags = mmap.MAP_SHARED | _MAP_FIXED | (mmap.MAP_POPULATE if populate else 0)
    if libc.mmap(start, length, prot, flags, fd, 0) != start:
        libc.munmap(reserved, length + HUGE_PAGE)
        return None
    if start > reserved:
        libc.munmap(reserved, start - reserved)
    end, reserved_end = start + round_up(length, mmap.PAGESIZE), reserved + length + HUGE_PAGE
    if reserved_end > end:
        libc.munmap(end, reserved_end - end)
    return AlignedMapping(start, length, libc)


def collapse_memfd(fd: int, size: int) -> bool:
    """Back the first ``size`` bytes (a multiple of HUGE_PAGE) of a new, unwritten memfd with huge pages
    (MADV_COLLAPSE); True where the kernel did. Writes a zero byte per huge page first (a range with no
    page at all is not collapsed), which leaves a new memfd's contents as they were: zeros."""
    if size <= 0 or size % HUGE_PAGE:
        return False
    mapping = map_aligned(fd, size, writable=True)
    if mapping is None:
        return False
    try:
        for offset in range(0, size, HUGE_PAGE):
            ctypes.memset(mapping.address + offset, 0, 1)
        return _libc().madvise(mapping.address, size, MADV_COLLAPSE) == 0
    finally:
        mapping.close()


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def pmd_mapped_bytes(address: int) -> int:
    """Bytes of this process's mapping that holds ``address`` mapped by huge-page entries (smaps'
    AnonHugePages, ShmemPmdMapped and FilePmdMapped): what the tests read to see what the kernel gave."""
    inside = False
    total = 0
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(x, 16) for x in head.split("-"))
                if inside:
                    break
                inside = low <= address < high
            elif inside and head in ("AnonHugePages:", "ShmemPmdMapped:", "FilePmdMapped:"):
                total += int(line.split()[1]) * 1024
    return total
