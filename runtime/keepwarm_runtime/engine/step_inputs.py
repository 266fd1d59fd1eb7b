"""A step's host tables (token ids, positions, KV slots, block tables), built by array operations into
buffers kept from step to step.

The model runner used to build them in Python lists, one element at a time (a slot per token, a
padded block-table row per sequence), then copy each list into a new tensor: at batch 64 that was the
largest part of the host's share of a decode step. Here the per-sequence numbers (tokens computed,
tokens scheduled, length, blocks) are read once into arrays and every table is a few numpy operations
over them, written into buffers that grow to the largest step seen and are then reused. On CPU the
tensors a step hands to the model are views of those buffers; on CUDA the buffers are pinned and each
table reaches the device in one non-blocking copy.

Buffers are used in turn (``DEPTH`` sets), so the tables one step handed out stay intact while the
next step is prepared; on CUDA a set is written again only after its copies have completed.

Most steps decode the same sequences as the step before, one token each. Such a step pays for few
array operations (each one costs several microseconds on a CPU whose caches the forward pass has just
filled with weights, whatever its size): the packing of one token per sequence is known without
counting, and the padded block table is kept from step to step (``_BlockTable``), its rows rewritten
only for the sequences whose block count changed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from keepwarm_runtime.engine.attention.metadata import AttentionMetadata
from keepwarm_runtime.engine.prompt_logprobs import PromptChunk, positions_to_score
from keepwarm_runtime.engine.scheduler import SchedulerOutput
from keepwarm_runtime.engine.sequence import Sequence

DEPTH = 2  # buffer sets used in turn
MAX_SHAPES = 64  # step shapes whose tensor views a buffer set keeps (decode steps repeat one for long)
# The host tables of a buffer set (its attributes): [tokens], [tokens], [tokens], [seqs + 1], [seqs] x 3,
# and the block tables, [seqs * blocks] viewed as [seqs, blocks] per step.
TABLES = (
    "input_ids",
    "positions",
    "slots",
    "query_start",
    "query_lens",
    "context_lens",
    "prompt_lens",
    "block_tables",
)


@dataclass
class StepRows:
    """Which rows of the packed step the lm head keeps."""

    sample_index: list[int] = field(default_factory=list)  # packed row of each sampled sequence
    sample_seqs: list[Sequence] = field(default_factory=list)
    prompt_index: list[int] = field(default_factory=list)  # packed rows of scored prompt positions
    prompt_chunks: list[PromptChunk] = field(default_factory=list)
    sample_rows: np.ndarray | None = None  # sample_index as a new int64 array (None: make it from the list)

    def kept(self) -> np.ndarray:
        """The rows the lm head keeps, sampled then scored, as a new int64 array (a tensor may share
        its memory); row 0 alone when there are none, since the pass still needs one."""
        sampled = self.sample_rows
        if sampled is None:
            sampled = np.array(self.sample_index, dtype=np.int64)
        if self.prompt_index:
            return np.concatenate([sampled, np.array(self.prompt_index, dtype=np.int64)])
        return sampled if len(sampled) else np.zeros(1, dtype=np.int64)


@dataclass
class StepTables:
    """One step's inputs as the model runner hands them on."""

    input_ids: torch.Tensor  # [T] int64 on the device
    positions: torch.Tensor  # [T] int64 on the device
    metadata: AttentionMetadata
    rows: StepRows
    # the sequences (batch indices) whose input token is pending, and that token's packed row
    pending_seqs: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    pending_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


class _Buffers:
    """One set of host tables, grown (never shrunk) to the largest step seen."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.tokens = self.seqs = self.table_size = 0
        self.copied: torch.cuda.Event | None = None  # recorded after this set's copies to the device
        self.one_each = 0  # B when query_start and query_lens hold a one-token-each step of B sequences
        # (tokens, seqs, blocks) -> the tensors a step of that shape hands on: made once per shape
        self.views: dict[tuple[int, int, int], dict[str, torch.Tensor]] = {}
        self.ensure(1, 1, 1)

    def _new(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(n, dtype=dtype, pin_memory=self.pin)

    def ensure(self, tokens: int, seqs: int, table_size: int) -> None:
        if tokens <= self.tokens and seqs <= self.seqs and table_size <= self.table_size:
            return
        self.views = {}
        self.one_each = 0
        if tokens > self.tokens:
            self.tokens = max(tokens, 2 * self.tokens)
            self.input_ids, self.positions, self.slots = (
                self._new(self.tokens, torch.long) for _ in range(3)
            )
        if seqs > self.seqs:
            self.seqs = max(seqs, 2 * self.seqs)
            self.query_start = self._new(self.seqs + 1, torch.int32)
            self.query_lens, self.context_lens, self.prompt_lens = (
                self._new(self.seqs, torch.long) for _ in range(3)
            )
        if table_size > self.table_size:
            self.table_size = max(table_size, 2 * self.table_size)
            self.block_tables = self._new(self.table_size, torch.int32)  # [B * max_blocks], viewed per step
        # numpy views of the same memory, made once (a .numpy() call per table and step adds up)
        self.np = {name: getattr(self, name).numpy() for name in TABLES}


class _BlockTable:
    """The padded block table of the last step, kept for the next: when that step schedules the same
    sequences in the same order, only the rows whose block count changed are written again. A
    scheduled sequence's ``block_ids`` only grow (BlockManager appends; freeing gives it a new, empty
    list, and a freed sequence is out of the running batch), so an unchanged count is an unchanged row."""

    def __init__(self) -> None:
        self.seqs: list[Sequence] = []  # the last step's sequences, in its order
        self.num_blocks = np.zeros(0, dtype=np.int64)  # [B] their block counts then
        self.table = np.zeros((0, 0), dtype=np.int32)  # [B, columns >= any count], zero-padded

    def update(self, seqs: list[Sequence], num_blocks: np.ndarray, width: int) -> np.ndarray:
        """The [B, width] table for ``seqs`` (a view of this object's array: read it before the next call)."""
        if seqs == self.seqs and width <= self.table.shape[1]:  # the same objects, in the same order
            for b in np.flatnonzero(num_blocks != self.num_blocks).tolist():
                ids, row = seqs[b].block_ids, self.table[b]
                row[: len(ids)] = ids
                row[len(ids) :] = 0
        else:
            self.table = np.zeros((len(seqs), 2 * width), dtype=np.int32)
            self.table[np.arange(2 * width) < num_blocks[:, None]] = np.fromiter(
                itertools.chain.from_iterable(s.block_ids for s in seqs), np.int32, int(num_blocks.sum())
            )
            self.seqs = list(seqs)
        self.num_blocks = num_blocks
        return self.table[:, :width]


class StepInputs:
    """Builds each step's tables for one device and block size (ModelRunner.prepare)."""

    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        pin = device.type == "cuda"
        self._sets = [_Buffers(pin) for _ in range(DEPTH)]
        self._turn = 0
        self._table = _BlockTable()
        self._ones = np.ones(1, dtype=np.int64)  # one token each: the counts and the query starts
        self._arange = np.arange(2, dtype=np.int64)

    def build(self, out: SchedulerOutput) -> StepTables:
        seqs, counts_list = out.seqs, out.num_scheduled_tokens
        batch, bs = len(seqs), self.block_size
        # One pass over the sequences: [B, 8] of tokens computed, length, blocks, prompt length,
        # whether it scores its prompt, the first token of its chunk and that token's KV slot, and its
        # pending tokens (flattened: fromiter is faster than an array of tuples). A pending token (sampled
        # by a step still running) is not in token_ids yet: its place holds the token before it, a
        # stand-in the step overwrites from the running step's output (engine/overlap.py).
        per_seq = np.fromiter(
            itertools.chain.from_iterable(
                [
                    (
                        (start := s.num_computed_tokens),
                        len(s.token_ids) + (pending := s.num_pending),
                        len(s.block_ids),
                        len(s.prompt_token_ids),
                        s.prompt_logprobs is not None,
                        s.token_ids[start - pending],
                        s.block_ids[start // bs] * bs + start % bs,
                        pending,
                    )
                    for s in seqs
                ]
            ),
            np.int64,
            8 * batch,
        ).reshape(batch, 8)
        starts, lengths, num_blocks, prompt_lens, scoring, first_ids, first_slots, pending = per_seq.T
        tokens = sum(counts_list)
        one_each = tokens == batch  # decodes and one-token chunks: no packing to work out
        if one_each:
            counts = self._one_each(batch)
            ends = starts + 1
        else:
            counts = np.array(counts_list, dtype=np.int64)
            ends = starts + counts
        width = int(num_blocks.max())
        buf = self._next(tokens, batch, batch * width)

        query_start = buf.np["query_start"][: batch + 1]
        if not one_each:
            query_start[0] = 0
            np.cumsum(counts, out=query_start[1:])
            buf.np["query_lens"][:batch] = counts
            buf.one_each = 0
        elif buf.one_each != batch:  # else they hold these values from this set's last step
            query_start[:] = self._arange[: batch + 1]
            buf.np["query_lens"][:batch] = counts
            buf.one_each = batch
        table = buf.np["block_tables"][: batch * width].reshape(batch, width)
        table[:] = self._table.update(seqs, num_blocks, width)
        input_ids, positions = buf.np["input_ids"][:tokens], buf.np["positions"][:tokens]
        slots = buf.np["slots"][:tokens]
        if one_each:
            input_ids[:] = first_ids
            positions[:] = starts
            slots[:] = first_slots
        else:
            input_ids[:] = np.fromiter(
                itertools.chain.from_iterable(
                    s.token_ids[p : p + n]  # from the stand-in where its first token is pending
                    for s, p, n in zip(seqs, (starts - pending).tolist(), counts_list, strict=True)
                ),
                np.int64,
                tokens,
            )
            owner = np.repeat(np.arange(batch), counts)
            positions[:] = np.arange(tokens) + np.repeat(starts - query_start[:-1], counts)
            slots[:] = table[owner, positions // bs].astype(np.int64) * bs + positions % bs
        buf.np["context_lens"][:batch] = ends
        buf.np["prompt_lens"][:batch] = prompt_lens

        dev = self._device_tensors(buf, tokens, batch, width)
        meta = AttentionMetadata(
            slot_mapping=dev["slots"],
            query_start=dev["query_start"],
            query_lens=dev["query_lens"],
            context_lens=dev["context_lens"],
            block_tables=dev["block_tables"],
            max_query_len=1 if one_each else int(counts.max()),
            max_context_len=int(ends.max()),
            block_size=bs,
            prefill_only=bool((starts == 0).all()),
            prompt_lens=dev["prompt_lens"],
            prompt_lens_list=prompt_lens.tolist(),
            query_lens_list=list(counts_list),
            context_lens_list=ends.tolist(),
            block_tables_list=[s.block_ids for s in seqs],  # the sequences' own: read within the step
        )
        waiting_on = np.flatnonzero(pending)
        return StepTables(
            dev["input_ids"],
            dev["positions"],
            meta,
            _rows(seqs, starts, ends, lengths, query_start, scoring),
            waiting_on,
            waiting_on if one_each else query_start[waiting_on].astype(np.int64),
        )

    def _one_each(self, batch: int) -> np.ndarray:
        """[batch] ones (kept, grown as needed, with ``_arange``: [batch + 1] of 0, 1, 2, ...)."""
        if len(self._ones) < batch:
            self._ones = np.ones(2 * batch, dtype=np.int64)
            self._arange = np.arange(2 * batch + 1, dtype=np.int64)
        return self._ones[:batch]

    def _next(self, tokens: int, batch: int, table_size: int) -> _Buffers:
        buf = self._sets[self._turn]
        self._turn = (self._turn + 1) % DEPTH
        if buf.copied is not None:
            buf.copied.synchronize()  # its last copies to the device have been read
            buf.copied = None
        buf.ensure(tokens, batch, table_size)
        return buf

    def _device_tensors(self, buf: _Buffers, tokens: int, batch: int, width: int) -> dict[str, torch.Tensor]:
        host = buf.views.get((tokens, batch, width))
        if host is None:
            if len(buf.views) >= MAX_SHAPES:
                buf.views.clear()
            host = buf.views[tokens, batch, width] = {
                "input_ids": buf.input_ids[:tokens],
                "positions": buf.positions[:tokens],
                "slots": buf.slots[:tokens],
                "query_start": buf.query_start[: batch + 1],
                "query_lens": buf.query_lens[:batch],
                "context_lens": buf.context_lens[:batch],
                "prompt_lens": buf.prompt_lens[:batch],
                "block_tables": buf.block_tables[: batch * width].view(batch, width),
            }
        if self.device.type == "cpu":
            return host
        dev = {name: t.to(self.device, non_blocking=True) for name, t in host.items()}
        if self.device.type == "cuda":
            buf.copied = torch.cuda.Event()
            buf.copied.record()
        return dev


def _rows(
    seqs: list[Sequence],
    starts: np.ndarray,
    ends: np.ndarray,
    lengths: np.ndarray,
    query_start: np.ndarray,
    scoring: np.ndarray,
) -> StepRows:
    """The sampled rows (each sequence whose last known token is in) and the scored prompt positions
    (``scoring``: the sequences that score their prompt, the only ones looked at again)."""
    last = ends == lengths  # the last known token is in: its logits give the next one
    if last.all():
        sampled = query_start[1:] - 1
        rows = StepRows(sampled.tolist(), list(seqs))
    else:
        picked = np.flatnonzero(last)
        sampled = query_start[1:][picked] - 1
        rows = StepRows(sampled.tolist(), [seqs[i] for i in picked.tolist()])
    rows.sample_rows = sampled.astype(np.int64)
    for b in np.flatnonzero(scoring).tolist():
        seq = seqs[b]
        start, end = int(starts[b]), int(ends[b])
        scored = positions_to_score(seq, start, end)
        if scored:
            first_row = int(query_start[b]) - start
            rows.prompt_index.extend(first_row + p for p in scored)
            rows.prompt_chunks.append(PromptChunk(seq, scored.start, len(scored)))
    return rows
