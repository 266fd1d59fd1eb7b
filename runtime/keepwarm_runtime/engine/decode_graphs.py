"""Decode steps replayed from CUDA graphs, one per batch-size bucket, over static input buffers.

On a GPU a small model's decode step is a fraction of a millisecond of kernels and some 20 ms of
Python launching them (issue 35: the H200 ran the 100M Llama at 3,125 tokens/s, bound by the host).
A graph captured once per bucket replays the whole forward pass, from the embedding through every
layer to the lm head, as one launch.

What a replay reads must stay where the capture saw it, so the step's inputs are copied into static
buffers sized for the largest bucket (token ids, positions, KV slots, context lengths, block tables,
the rows the lm head keeps). A step of B sequences takes the smallest bucket of at least B; its rows
B.. are padding: token 0 at position ``pad_position``, its keys and values written into a KV block
kept out of circulation (``BlockManager.reserve``) and attending to that block alone, so padding
never touches a sequence's cache and never reads an unwritten key. The attention backend plans each
replay's page table outside the graph (``graph_metadata``: FlashInfer's CUDA-graph decode wrapper,
one per bucket, its page-table buffers fixed).

Only steps where every sequence decodes one token and is sampled take a graph; prefills, chunks,
prompt logprobs, LoRA and multimodal steps, batches over the largest bucket, tensor-parallel ranks and
``--enforce-eager`` run eagerly as before. A capture that runs out of memory leaves its bucket eager
from then on; any other failure (an operator that syncs or cannot be captured, a model whose layers
need several attention plans a pass, such as Gemma 2's alternating windows: ``GraphUnsupported``)
every bucket. It is logged once and never fails a request: the step in hand runs eagerly (the
forward pass is a function of its inputs and the cache, and a step's keys and values written twice
are the same bytes). A start (warm or restored) captures nothing: once the server is ready, an idle
engine captures the buckets one at a time, smallest first, on a step of padding rows alone
(``capture_next``: they write the reserved block only), checking for requests between captures; a
bucket a step needs before then is captured on that step.

CPU twin: ``capture=False`` runs the same padded static-buffer steps eagerly (a CPU has no graph to
replay), so the buckets, the padding, the reserved block and the rows handed back are tested in CI;
the capture and the replay themselves run in scripts/gpu-check only.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from keepwarm_runtime.engine.attention.metadata import AttentionMetadata, use_metadata
from keepwarm_runtime.log_once import warning_once

log = logging.getLogger(__name__)

LARGEST_BUCKET = 256  # batches above this (or above max_num_seqs) run eagerly
POOL_SLACK_BYTES = 64 << 20  # beyond the activation estimate: the graphs' own allocations
PLANNER_BYTES = 8 << 20  # a bucket's attention planner workspace (FlashInfer's int workspace a wrapper)


class GraphUnsupported(RuntimeError):
    """A pass that cannot be replayed from a graph (raised while capturing; the bucket runs eagerly)."""


def capture_sizes(max_num_seqs: int, largest: int = LARGEST_BUCKET) -> tuple[int, ...]:
    """The buckets: 1, 2, 4, 8, then every 16 up to the most sequences a step holds (vLLM's ladder);
    padding a step costs at most 15 rows beyond 16."""
    top = max(1, min(max_num_seqs, largest))
    return tuple(sorted({s for s in (1, 2, 4, 8) if s < top} | set(range(16, top, 16)) | {top}))


def bucket(batch: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest bucket holding ``batch`` sequences; None when the batch is over the largest."""
    i = bisect.bisect_left(sizes, batch)
    return sizes[i] if i < len(sizes) else None


def graph_bytes(
    hidden: int, intermediate: int, vocab: int, itemsize: int, sizes: tuple[int, ...], max_blocks_per_seq: int
) -> int:
    """What the graphs may hold, counted out of the KV cache's budget: their shared pool (the largest
    bucket's activations, a few hidden- and intermediate-size rows a token live at once, and its logits
    in the model's dtype and in float32), each bucket's page-table buffers (int32, every sequence at
    full length) and planner workspace, and some slack."""
    per_row = (8 * hidden + 3 * intermediate) * itemsize + vocab * (itemsize + 4)
    page_tables = 4 * sum(sizes) * (max_blocks_per_seq + 2)
    return sizes[-1] * per_row + page_tables + len(sizes) * PLANNER_BYTES + POOL_SLACK_BYTES


@dataclass
class _Bucket:
    logits: torch.Tensor | None = None  # the graph's output, [bucket size, vocab]; None in the CPU twin
    graph: torch.cuda.CUDAGraph | None = None


# A text pass of the model, the attention metadata set by the caller: (ids, positions, kept rows) -> logits
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class DecodeGraphs:
    """The buckets' graphs and the static buffers they read (one set, sized for the largest bucket)."""

    def __init__(
        self,
        forward: Forward,
        backend,
        device: torch.device,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        scratch_block: int,
        capture: bool = True,
    ) -> None:
        """``forward``: the model's pass (metadata set by the caller); ``backend``: the layers' attention
        backend, which must have ``graph_metadata``; ``scratch_block``: a KV block no sequence is given."""
        self.forward, self.backend, self.capture = forward, backend, capture
        self.sizes = capture_sizes(max_num_seqs)
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.pad_position = min(1, block_size - 1)  # two keys in the scratch block where it holds two
        self.pad_keys = self.pad_position + 1  # the keys a padding row attends to (its context length)
        n = self.sizes[-1]
        longs = {"dtype": torch.long, "device": device}
        self.input_ids = torch.zeros(n, **longs)
        self.positions = torch.zeros(n, **longs)
        self.slots = torch.zeros(n, **longs)
        self.context_lens = torch.zeros(n, **longs)
        self.prompt_lens = torch.zeros(n, **longs)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.query_lens = torch.ones(n, **longs)
        self.keep = torch.arange(n, **longs)
        self.buckets: dict[int, _Bucket] = {}
        self.eager: set[int] = set()  # buckets whose capture failed
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.replays = 0  # steps served from a bucket (graph or twin), for tests and logs

    def run(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """The logits of a decode step of one token per sequence, every one sampled ([B, vocab], rows
        in step order, valid until the next call), or None: run this step eagerly."""
        batch = ids.shape[0]
        size = bucket(batch, self.sizes)
        if size is None or size in self.eager or meta.block_tables.shape[1] > self.block_tables.shape[1]:
            return None
        static = self._fill(ids, positions, meta, batch, size)
        try:
            static.backend_metadata = self.backend.graph_metadata(static, size)
            entry = self.buckets.get(size)
            if entry is None:
                entry = self.buckets[size] = self._capture(size, static)
        except Exception as exc:  # any failure of a capture is the eager path's to serve
            self._give_up(size, exc)
            return None
        self.replays += 1
        if entry.graph is None:  # the CPU twin: the same static, padded step, run eagerly
            with use_metadata(static):
                return self._pass(size)[:batch]
        entry.graph.replay()
        return entry.logits[:batch]

    def capture_next(self) -> int | None:
        """Capture the smallest bucket not yet captured nor fallen back, on a step of padding rows
        alone (for an idle engine: no sequence's cache is touched); its size, or None when every
        bucket is done. A failure falls back as on a step (``_give_up``)."""
        size = next((s for s in self.sizes if s not in self.buckets and s not in self.eager), None)
        if size is None:
            return None
        static = self._fill(*self._no_rows(), 0, size)
        try:
            static.backend_metadata = self.backend.graph_metadata(static, size)
            self.buckets[size] = self._capture(size, static)
        except Exception as exc:
            self._give_up(size, exc)
        return size

    def _no_rows(self) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """A step of no sequence (ids, positions, metadata), for ``_fill`` to pad up to a bucket."""
        meta = AttentionMetadata(
            slot_mapping=self.slots[:0],
            query_start=self.query_start[:1],
            query_lens=self.query_lens[:0],
            context_lens=self.context_lens[:0],
            block_tables=self.block_tables[:0, :1],
            max_query_len=1,
            max_context_len=0,
            block_size=self.block_size,
            prefill_only=False,
            query_lens_list=[],
            context_lens_list=[],
            block_tables_list=[],
            prompt_lens=self.prompt_lens[:0],
            prompt_lens_list=[],
        )
        return self.input_ids[:0], self.positions[:0], meta

    def _pass(self, size: int) -> torch.Tensor:
        return self.forward(self.input_ids[:size], self.positions[:size], self.keep[:size])

    def _capture(self, size: int, static: AttentionMetadata) -> _Bucket:
        """The bucket's graph (CUDA), or its twin's empty entry. An eager pass first, on the same
        buffers (the twin's too): it loads the kernels and plans the attention outside the graph."""
        with use_metadata(static):
            self._pass(size)
        if not self.capture:
            return _Bucket()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with use_metadata(static), torch.cuda.graph(graph, pool=self.pool):
            logits = self._pass(size)
        log.info("decode graph captured for %d sequences", size)
        return _Bucket(logits, graph)

    def _give_up(self, size: int, exc: Exception) -> None:
        # out of memory: a smaller bucket may still fit; anything else (a second attention plan, an
        # operator that syncs or cannot be captured, as a MoE's routing) fails every bucket alike
        self.eager.update((size,) if isinstance(exc, torch.OutOfMemoryError) else self.sizes)
        self.buckets.pop(size, None)
        message = "decode steps of %d sequences run eagerly, their CUDA graph failed: %s"
        if not warning_once(log, "decode graph failed", message, size, exc):  # news once a process
            log.debug(message, size, exc)

    def _fill(
        self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, batch: int, size: int
    ) -> AttentionMetadata:
        """The step's inputs in the static buffers, rows batch..size padding; the metadata over them."""
        width = meta.block_tables.shape[1]
        self.input_ids[:batch].copy_(ids)
        self.positions[:batch].copy_(positions)
        self.slots[:batch].copy_(meta.slot_mapping)
        self.context_lens[:batch].copy_(meta.context_lens)
        prompt_lens = meta.context_lens if meta.prompt_lens is None else meta.prompt_lens
        self.prompt_lens[:batch].copy_(prompt_lens)
        self.block_tables[:batch, :width].copy_(meta.block_tables)
        pads = size - batch
        if pads:  # a larger step may have left its rows here
            pad = self.pad_position
            self.input_ids[batch:size].fill_(0)
            self.positions[batch:size].fill_(pad)
            self.slots[batch:size].fill_(self.scratch_block * self.block_size + pad)
            self.context_lens[batch:size].fill_(self.pad_keys)
            self.prompt_lens[batch:size].fill_(self.pad_keys)
            self.block_tables[batch:size, 0].fill_(self.scratch_block)
        return replace(
            meta,
            slot_mapping=self.slots[:size],
            query_start=self.query_start[: size + 1],
            query_lens=self.query_lens[:size],
            context_lens=self.context_lens[:size],
            block_tables=self.block_tables[:size],
            max_query_len=1,
            max_context_len=max(meta.max_context_len, self.pad_keys),
            prefill_only=False,
            prompt_lens=self.prompt_lens[:size],
            prompt_lens_list=[
                *(meta.prompt_lens_list or meta.context_lens_list),
                *[self.pad_keys] * pads,
            ],
            query_lens_list=[1] * size,
            context_lens_list=[*meta.context_lens_list, *[self.pad_keys] * pads],
            block_tables_list=[*meta.block_tables_list, *[[self.scratch_block]] * pads],
            backend_metadata=None,
        )
