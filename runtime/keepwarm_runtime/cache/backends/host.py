"""Host tier: one sealed memfd arena per model; clients map it read-only and share its pages.

The daemon writes the arena through a temporary writable mapping, unmaps it and seals the memfd
(no write, grow or shrink) so nobody — the daemon included — can change weights that clients map.
Huge pages make a multi-GiB map cheaper (512x fewer page-table entries to fault in: 2 GiB in 0.001 s
instead of 0.08-0.16 s, weights/huge_pages.py) for arenas of HUGE_ARENA_MIN or more; we try MFD_HUGETLB first
(needs a reserved hugetlb pool: vm.nr_hugepages), then transparent huge pages for shmem: collapsed
into them before the arena is written (MADV_COLLAPSE, Linux 6.1, granted whatever
/sys/kernel/mm/transparent_hugepage/shmem_enabled says except ``deny``), else asked for where that
setting allows (always|within_size|advise), and otherwise 4 KiB pages. ``HostArena.page_mode`` says
which one this kernel gave us. Clients map an arena at an address aligned to 2 MiB
(``map_readonly``), where each of its huge pages takes one page-table entry. An arena whose seals do
not hold is refused (``ArenaSealError``), never served.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from keepwarm_runtime.weights.huge_pages import (
    HUGE_PAGE,
    AlignedMapping,
    collapse_memfd,
    map_aligned,
    round_up,
    thp_mode,
)

if TYPE_CHECKING:  # torch only where a tensor is made: holding or adopting an arena needs none
    import torch

SMALL_PAGE = mmap.PAGESIZE
# Arenas smaller than this stay on 4 KiB pages: whole huge pages would waste up to 2 MiB each (a LoRA
# adapter's arena is a few MiB), and their map costs little either way (64 MiB: ~2.5 ms on 4 KiB pages)
HUGE_ARENA_MIN = 32 * HUGE_PAGE
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
_THP_SHMEM = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")


class ArenaSealError(OSError):
    """The memfd could not be sealed; the daemon refuses to serve such an arena."""


def thp_shmem_mode() -> str:
    """The kernel's THP policy for shmem/memfd ('never', 'advise', 'always', ...), or 'unavailable'."""
    return thp_mode(_THP_SHMEM)


def page_facts() -> dict[str, str]:
    """The kernel settings that decide a host arena's pages, for benchmark reports: with 4 KiB pages a
    client's map of a 2 GiB arena costs ~0.1 s of page-table setup, with huge pages ~0.001 s.
    ``thp_collapse``: whether this kernel collapses a memfd into huge pages (tried on one)."""

    def read(path: str) -> str:
        try:
            return Path(path).read_text().strip()
        except OSError:
            return "unavailable"

    probe = os.memfd_create("keepwarm:probe", os.MFD_CLOEXEC)
    try:
        os.ftruncate(probe, HUGE_PAGE)
        collapses = collapse_memfd(probe, HUGE_PAGE)
    finally:
        os.close(probe)
    return {
        "thp_enabled": read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "thp_shmem": thp_shmem_mode(),
        "thp_collapse": "yes" if collapses else "no",
        "hugetlb_pages_total": read("/proc/sys/vm/nr_hugepages"),
    }


def arena_bytes(size: int, try_huge: bool = True) -> int:
    """The memory a HostArena of ``size`` bytes takes: whole huge pages where it asks for them (the
    daemon's budget counts this, not the tensors' bytes)."""
    return round_up(max(size, 1), HUGE_PAGE if _asks_huge(size, try_huge) else SMALL_PAGE)


def _asks_huge(size: int, try_huge: bool) -> bool:
    return try_huge and size >= HUGE_ARENA_MIN


class HostArena:
    """A memfd of ``size`` bytes (``arena_bytes`` of them); writable in the daemon until ``seal()``."""

    def __init__(self, name: str, size: int, *, try_huge: bool = True) -> None:
        self.name = name
        self.page_mode = "4k"
        self.fd = -1
        self._map: mmap.mmap | None = None
        try_huge = _asks_huge(size, try_huge)
        if try_huge:
            self._try_hugetlb(name, size)
        if self.fd < 0:
            self.size = arena_bytes(size, try_huge)
            self.fd = os.memfd_create(f"keepwarm:{name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            os.ftruncate(self.fd, self.size)
            if try_huge and collapse_memfd(self.fd, self.size):
                self.page_mode = "thp"
            self._map = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            if (
                self.page_mode == "4k"
                and try_huge
                and thp_shmem_mode() in ("advise", "always", "within_size")
            ):
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
        self.size = arena_bytes(size)
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


def map_readonly(fd: int, size: int, populate: bool = True) -> mmap.mmap | AlignedMapping:
    """Client side: map an arena read-only at an address aligned to 2 MiB (each of a huge-page arena's
    pages one page-table entry; Python's own mmap is used only where that cannot be made);
    ``populate`` prefaults the page tables in one call (MAP_POPULATE), much cheaper than one fault per
    page during the first forward pass."""
    aligned = map_aligned(fd, size, populate=populate)
    if aligned is not None:
        return aligned
    flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
    return mmap.mmap(fd, size, flags, mmap.PROT_READ)


def readonly_tensor(
    buf: mmap.mmap | AlignedMapping, offset: int, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    """A tensor viewing ``buf``; it keeps ``buf`` alive. Writing to it faults (read-only pages)."""
    import torch

    count = _numel(shape) * dtype.itemsize
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable": that is the point
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        source = buf.array() if isinstance(buf, AlignedMapping) else buf
        flat = torch.frombuffer(source, dtype=torch.uint8, count=count, offset=offset)
    return flat.view(dtype).view(shape)
