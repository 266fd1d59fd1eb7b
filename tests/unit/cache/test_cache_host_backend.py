"""Host arena: fill, seal, read-only client mapping, and what this kernel allows for huge pages."""

from __future__ import annotations

import mmap

import pytest
import torch

from keepwarm_runtime.cache.backends.host import HostArena, map_readonly, readonly_tensor, thp_shmem_mode


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


def test_page_mode_is_reported():
    arena = HostArena("t", 1 << 20)
    try:
        assert arena.page_mode in ("hugetlb", "thp", "4k")
        if thp_shmem_mode() == "never" and arena.page_mode != "hugetlb":
            assert arena.page_mode == "4k"
    finally:
        arena.close()


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
