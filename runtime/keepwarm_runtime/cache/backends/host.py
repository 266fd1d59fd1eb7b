"""Host tier: one sealed memfd arena per model; clients map it read-only and share its pages.

The daemon writes the arena through a temporary writable mapping, unmaps it and seals the memfd
(no write, grow or shrink) so nobody — the daemon included — can change weights that clients map.
Huge pages make a multi-GiB map cheaper (512x fewer page-table entries to fault in); we try
MFD_HUGETLB first (needs a reserved hugetlb pool: vm.nr_hugepages), then transparent huge pages
for shmem (needs /sys/kernel/mm/transparent_hugepage/shmem_enabled = always|within_size|advise),
and otherwise use 4 KiB pages. ``HostArena.page_mode`` says which one this kernel gave us. An arena
whose seals do not hold is refused (``ArenaSealError``), never served.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only where a tensor is made: holding or adopting an arena needs none
    import torch

HUGE_PAGE = 2 << 20
SMALL_PAGE = mmap.PAGESIZE
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
_THP_SHMEM = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")


class ArenaSealError(OSError):
    """The memfd could not be sealed; the daemon refuses to serve such an arena."""


def thp_shmem_mode() -> str:
    """The kernel's THP policy for shmem/memfd ('never', 'advise', 'always', ...), or 'unavailable'."""
    try:
        match = re.search(r"\[(\w[\w-]*)\]", _THP_SHMEM.read_text())
    except OSError:
        return "unavailable"
    return match.group(1) if match else "unavailable"


def page_facts() -> dict[str, str]:
    """The kernel settings that decide a host arena's pages, for benchmark reports: with 4 KiB pages a
    client's map of a 2 GiB arena costs ~0.15 s of page-table setup, with huge pages ~0.01 s."""

    def read(path: str) -> str:
        try:
            return Path(path).read_text().strip()
        except OSError:
            return "unavailable"

    return {
        "thp_enabled": read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "thp_shmem": thp_shmem_mode(),
        "hugetlb_pages_total": read("/proc/sys/vm/nr_hugepages"),
    }


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class HostArena:
    """A memfd of ``size`` bytes; writable in the daemon until ``seal()``."""

    def __init__(self, name: str, size: int, *, try_huge: bool = True) -> None:
        self.name = name
        self.page_mode = "4k"
        self.fd = -1
        self._map: mmap.mmap | None = None
        if try_huge:
            self._try_hugetlb(name, size)
        if self.fd < 0:
            self.size = _round_up(max(size, 1), HUGE_PAGE if thp_shmem_mode() != "never" else SMALL_PAGE)
            self.fd = os.memfd_create(f"keepwarm:{name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            os.ftruncate(self.fd, self.size)
            self._map = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            if try_huge and thp_shmem_mode() in ("advise", "always", "within_size"):
                try:
                    self._map.madvise(mmap.MADV_HUGEPAGE)
                    self.page_mode = "thp"
                except OSError:
                    pass

    def _try_hugetlb(self, name: str, size: int) -> None:
        flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | os.MFD_HUGETLB
        try:
            fd = os.memfd_create(f"keepwarm:{name}", flags)
        except OSError:
            return
        self.size = _round_up(max(size, 1), HUGE_PAGE)
        try:
            os.ftruncate(fd, self.size)
            # MAP_SHARED reserves the huge pages now; an empty pool fails here with ENOMEM.
            self._map = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(fd)
            return
        self.fd, self.page_mode = fd, "hugetlb"

    def tensor(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """Writable view for filling (daemon side, before ``seal``)."""
        import torch

        if self._map is None:
            raise RuntimeError(f"arena {self.name} is sealed")
        count = _numel(shape) * dtype.itemsize
        flat = torch.frombuffer(self._map, dtype=torch.uint8, count=count, offset=offset)
        return flat.view(dtype).view(shape)

    def seal(self) -> None:
        """Drop the writable mapping and seal the memfd (no write, grow, shrink, or more seals).

        Raises ArenaSealError when the kernel refuses or the seals do not all hold: an unsealed
        arena could be changed under the clients that map it, so the daemon never serves one.
        """
        if self._map is not None:
            self._map.close()  # fails if a fill view is still alive: a bug worth seeing
            self._map = None
        try:
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)
            held = fcntl.fcntl(self.fd, fcntl.F_GET_SEALS)
        except OSError as exc:
            raise ArenaSealError(f"arena {self.name} ({self.page_mode} pages): cannot seal: {exc}") from None
        if held & _SEALS != _SEALS:
            raise ArenaSealError(f"arena {self.name}: seals {held:#x} lack {_SEALS & ~held:#x}")

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class AdoptedArena:
    """An arena received from a predecessor daemon or the holder: its sealed memfd (or, on the gpu tier,
    its VMM POSIX-fd handle) and size. It is never written, so it needs no mapping of its own."""

    def __init__(self, name: str, fd: int, size: int, page_mode: str) -> None:
        self.name, self.fd, self.size, self.page_mode = name, fd, size, page_mode

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def verify_sealed(name: str, fd: int, size: int) -> None:
    """A host arena handed over must be a memfd of ``size`` bytes whose seals all hold, as ``seal``
    left it: anything else could change under its clients (ArenaSealError)."""
    try:
        actual = os.fstat(fd).st_size
        held = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        raise ArenaSealError(f"arena {name}: not a sealable memfd: {exc}") from None
    if actual != size:
        raise ArenaSealError(f"arena {name}: {actual} bytes, the record says {size}")
    if held & _SEALS != _SEALS:
        raise ArenaSealError(f"arena {name}: seals {held:#x} lack {_SEALS & ~held:#x}")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def map_readonly(fd: int, size: int, populate: bool = True) -> mmap.mmap:
    """Client side: map an arena read-only; ``populate`` prefaults the page tables in one call
    (MAP_POPULATE), much cheaper than one fault per page during the first forward pass."""
    flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
    return mmap.mmap(fd, size, flags, mmap.PROT_READ)


def readonly_tensor(buf: mmap.mmap, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor viewing ``buf``; it keeps ``buf`` alive. Writing to it faults (read-only pages)."""
    import torch

    count = _numel(shape) * dtype.itemsize
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable": that is the point
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        flat = torch.frombuffer(buf, dtype=torch.uint8, count=count, offset=offset)
    return flat.view(dtype).view(shape)
