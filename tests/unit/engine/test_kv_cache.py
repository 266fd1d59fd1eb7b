"""engine/kv_cache.py ``zeros``: a CPU cache tensor is zeros of its shape over a lazily zeroed mapping,
on huge pages where it spans one or more and the kernel's THP setting gives them (read back from
/proc/self/smaps), on 4 KiB pages below that."""

from __future__ import annotations

import pytest
import torch

from keepwarm_runtime.engine.kv_cache import zeros
from keepwarm_runtime.weights.huge_pages import HUGE_PAGE, pmd_mapped_bytes, round_up, thp_mode

CPU = torch.device("cpu")
THP_ON = thp_mode() in ("always", "madvise")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cache_of_huge_pages_size_is_zeros_on_huge_pages(dtype: torch.dtype) -> None:
    # [blocks, block_size, kv_heads, dim] of 2.5 huge pages: the mapping rounds up, the tensor does not.
    blocks = 5 * HUGE_PAGE // (2 * 16 * 2 * 64 * dtype.itemsize)
    cache = zeros((blocks, 16, 2, 64), dtype, CPU)
    assert cache.shape == (blocks, 16, 2, 64) and cache.dtype == dtype and cache.is_contiguous()
    assert not cache.any()
    cache.fill_(1)  # every page touched
    assert cache.sum().item() == cache.numel()
    mapped = round_up(cache.numel() * dtype.itemsize, HUGE_PAGE)
    # The whole rounded-up mapping: the kernel places a mapping of whole huge pages aligned (Linux 6.7).
    assert pmd_mapped_bytes(cache.data_ptr()) == (mapped if THP_ON else 0)


def test_a_small_cache_stays_on_small_pages() -> None:
    cache = zeros((7, 16, 2, 64), torch.float32, CPU)  # 56 KiB
    cache.fill_(1)
    assert cache.shape == (7, 16, 2, 64) and cache.sum().item() == cache.numel()
    assert pmd_mapped_bytes(cache.data_ptr()) == 0


def test_caches_are_separate_memory() -> None:
    shape = (HUGE_PAGE // (16 * 64 * 4), 16, 1, 64)  # exactly one huge page
    first, second = zeros(shape, torch.float32, CPU), zeros(shape, torch.float32, CPU)
    first.fill_(3)
    assert not second.any() and first.data_ptr() != second.data_ptr()


def test_an_empty_shape() -> None:
    assert zeros((0, 16, 2, 64), torch.float32, CPU).shape == (0, 16, 2, 64)
