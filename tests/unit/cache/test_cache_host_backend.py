"""Host arena: fill, seal, read-only client mapping, and what this kernel allows for huge pages (a
client's map of a huge-page arena takes one page-table entry per 2 MiB)."""

from __future__ import annotations

import gc
import mmap
import os
import platform

import pytest
import torch

from keepwarm_runtime.cache.backends.host import (
    HUGE_ARENA_MIN,
    HostArena,
    map_readonly,
    readonly_tensor,
    thp_shmem_mode,
)
from keepwarm_runtime.weights.huge_pages import HUGE_PAGE, collapse_memfd, map_aligned, pmd_mapped_bytes


def test_fill_seal_and_map_readonly():
    arena = HostArena("t", 10_000)
    try:
        assert arena.size % mmap.PAGESIZE == 0 and arena.size >= 10_000
        arena.tensor(256, torch.float32, (4, 4)).copy_(torch.arange(16.0).view(4, 4))
        arena.seal()
        buf = map_readonly(arena.fd, arena.size)
        t = readonly_tensor(buf, 256, torch.float32, (4, 4))
        assert torch.equal(t, torch.arange(16.0).view(4, 4))
        with pytest.raises(PermissionError):  # sealed: nobody may map it writable and shared
            mmap.mmap(arena.fd, arena.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(RuntimeError, match="sealed"):
            arena.tensor(0, torch.float32, (1,))
    finally:
        arena.close()


def _collapse_allowed() -> bool:
    """MADV_COLLAPSE exists from Linux 6.1; shmem_enabled=deny refuses it."""
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    return (major, minor) >= (6, 1) and thp_shmem_mode() not in ("deny", "unavailable")


def _mapped_whole(arena: HostArena) -> int:
    """Bytes of a client's read-only map of the sealed ``arena`` that huge-page entries map."""
    buf = map_readonly(arena.fd, arena.size)
    tensor = readonly_tensor(buf, 0, torch.uint8, (arena.size,))
    assert int(tensor[::4096].sum()) == 0  # untouched: zeros, read through the map
    return pmd_mapped_bytes(tensor.data_ptr())


def test_huge_page_arena_is_mapped_by_huge_entries_in_a_client():
    """Whatever shmem_enabled says (never on this project's VMs), the arena is collapsed into huge
    pages before it is written, and a client's map takes them whole."""
    if not _collapse_allowed():
        pytest.skip(f"MADV_COLLAPSE needs Linux 6.1 and shmem_enabled other than deny ({platform.release()})")
    arena = HostArena("t", HUGE_ARENA_MIN + 5)  # not a whole number of huge pages: rounded up
    try:
        assert arena.page_mode in ("hugetlb", "thp")
        assert arena.size == HUGE_ARENA_MIN + HUGE_PAGE
        arena.seal()
        assert _mapped_whole(arena) == arena.size
    finally:
        arena.close()


@pytest.mark.parametrize("size,try_huge", [(HUGE_ARENA_MIN, False), (HUGE_ARENA_MIN - 1, True)])
def test_an_arena_without_huge_pages_is_mapped_by_small_entries(size, try_huge):
    """Asked not to, or too small to be worth whole huge pages (a LoRA adapter's few MiB)."""
    arena = HostArena("t", size, try_huge=try_huge)
    try:
        assert arena.page_mode == "4k" and arena.size == size + (size % 4096 and 4096 - size % 4096)
        arena.seal()
        assert _mapped_whole(arena) == 0
    finally:
        arena.close()


def test_collapse_refuses_what_it_cannot_do_whole():
    fd = os.memfd_create("t")
    try:
        os.ftruncate(fd, HUGE_PAGE)
        assert not collapse_memfd(fd, HUGE_PAGE + 4096)  # not whole huge pages
        assert not collapse_memfd(fd, 0)
    finally:
        os.close(fd)


def test_an_aligned_map_lives_as_long_as_its_tensors():
    fd = os.memfd_create("t")
    try:
        os.ftruncate(fd, 2 * HUGE_PAGE)
        os.pwrite(fd, b"keepwarm", HUGE_PAGE)
        mapping = map_aligned(fd, 2 * HUGE_PAGE)
        assert mapping is not None and mapping.address % HUGE_PAGE == 0
        tensor = readonly_tensor(mapping, HUGE_PAGE, torch.uint8, (8,))
        del mapping
        gc.collect()
        assert bytes(tensor.tolist()) == b"keepwarm"  # still mapped: the tensor keeps it
        again = map_aligned(fd, 4096)
        assert again is not None
        again.close()
        again.close()  # a second close is a no-op, not a second munmap
    finally:
        os.close(fd)


def test_empty_tensor_view():
    arena = HostArena("t", 4096)
    arena.seal()
    buf = map_readonly(arena.fd, arena.size)
    assert readonly_tensor(buf, 0, torch.float32, (0, 3)).shape == (0, 3)
    arena.close()


def _seal_refused(arena: HostArena) -> HostArena:
    """Make the kernel refuse every later seal (F_SEAL_SEAL alone), as a failed seal would."""
    import fcntl

    fcntl.fcntl(arena.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL)
    return arena


def test_failed_seal_is_refused():
    from keepwarm_runtime.cache.backends.host import ArenaSealError

    arena = _seal_refused(HostArena("t", 4096))
    try:
        with pytest.raises(ArenaSealError, match="cannot seal"):
            arena.seal()
    finally:
        arena.close()


def test_daemon_never_serves_an_unsealed_arena(tmp_path, monkeypatch):
    from prometheus_client import generate_latest
    from safetensors.torch import save_file

    from keepwarm_runtime.cache.backends.host import ArenaSealError
    from keepwarm_runtime.cache.daemon import CacheDaemon, DaemonConfig

    (tmp_path / "m").mkdir()
    save_file({"w": torch.ones(8, 8)}, tmp_path / "m" / "model.safetensors")
    daemon = CacheDaemon(DaemonConfig(tmp_path / "wc", tier="host", dtype="float32"))
    monkeypatch.setattr(daemon, "_new_arena", lambda name, size: _seal_refused(HostArena(name, size)))
    with pytest.raises(ArenaSealError):
        daemon.add_model(tmp_path / "m")
    snap = daemon.snapshot()
    assert snap.models == {} and "cannot seal" in snap.failed["m"].reason
    assert "keepwarm_cache_seal_failures_total 1.0" in generate_latest(daemon.metrics.registry).decode()
    daemon.close()
