"""AttentionMetadata: what every attention layer needs to know about the current batch.

One small object per forward pass, set by the model runner around the call (nano-vllm's context), so
the transformers model keeps its plain `forward(input_ids, position_ids)` signature. Tokens of all
sequences are packed into one row: sequence b owns tokens query_start[b]:query_start[b+1]. What a
backend derives from it for every layer (gather indices, page tables, plans) is that backend's own
typed object, built once per pass by its `build()` (vLLM v1's AttentionMetadataBuilder), never
looked up by string keys.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: KV-cache slot (block * block_size + offset) of each new token
    query_start: torch.Tensor  # [B+1] int32 on the device: cumulative new-token counts
    query_lens: torch.Tensor  # [B] int64: new tokens per sequence
    context_lens: torch.Tensor  # [B] int64: tokens each sequence attends to (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    max_query_len: int
    max_context_len: int
    block_size: int
    prefill_only: bool  # no sequence has cached K/V: attend to the new K/V directly
    # The same on the host, required so that no builder is handed an empty list (FlashInfer's page
    # table is built from these; a runner that left one out failed only on a GPU).
    query_lens_list: list[int]
    context_lens_list: list[int]
    block_tables_list: list[list[int]]  # unpadded
    prompt_lens: torch.Tensor | None = None  # [B] int64: prompt length per sequence (None: all prompt)
    prompt_lens_list: list[int] | None = None
    backend_metadata: Any = None  # the backend's typed metadata for this pass, from its build()


_current: AttentionMetadata | None = None


def get_metadata() -> AttentionMetadata | None:
    return _current


@contextlib.contextmanager
def use_metadata(meta: AttentionMetadata | None) -> Iterator[None]:
    global _current
    previous, _current = _current, meta
    try:
        yield
    finally:
        _current = previous
