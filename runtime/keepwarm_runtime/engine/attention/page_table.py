"""The paged-KV page table FlashInfer plans with (CSR form), made from the scheduler's host lists.

Pure and torch-free, so it is tested on CPU although FlashInfer itself needs CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PageTable:
    indptr: list[int]  # [B+1]: sequence b's pages are indices[indptr[b]:indptr[b+1]]
    indices: list[int]  # the KV blocks every sequence attends to, in token order
    last_page_len: list[int]  # [B]: tokens in each sequence's last page (1..block_size)


def page_table(context_lens: list[int], block_tables: list[list[int]], block_size: int) -> PageTable:
    """Only the blocks that hold a sequence's `context_lens` tokens; blocks allocated ahead are left out."""
    indptr, indices, last = [0], [], []
    for ctx, table in zip(context_lens, block_tables, strict=True):
        pages = -(-ctx // block_size)
        if pages > len(table):
            raise ValueError(f"{ctx} tokens need {pages} blocks, the table has {len(table)}")
        indices.extend(table[:pages])
        indptr.append(indptr[-1] + pages)
        last.append(ctx - (pages - 1) * block_size)
    return PageTable(indptr, indices, last)
