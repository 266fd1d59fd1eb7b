"""FlashInfer's page table, built on the host from the scheduler's lists (no device round trip)."""

from __future__ import annotations

import pytest

from keepwarm_runtime.engine.attention.page_table import page_table


def test_only_the_blocks_holding_context_enter_the_table() -> None:
    # block size 4: 9 tokens fill 3 blocks (1 in the last); 4 tokens exactly one; 1 token one
    table = page_table([9, 4, 1], [[7, 2, 5, 11], [3], [8, 9]], 4)
    assert table.indptr == [0, 3, 4, 5]
    assert table.indices == [7, 2, 5, 3, 8]
    assert table.last_page_len == [1, 4, 1]


def test_a_table_shorter_than_the_context_is_refused() -> None:
    with pytest.raises(ValueError, match="9 tokens need 3 blocks"):
        page_table([9], [[1, 2]], 4)
