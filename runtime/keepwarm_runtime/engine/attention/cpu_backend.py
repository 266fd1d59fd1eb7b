"""CPU attention backend: decodes read the paged cache in place through keepwarm's compiled kernel.

A decode step is most of a serving run, and on CPU the torch backend spends it copying: each layer
gathers every decoding sequence's keys and values into a padded grid that SDPA then reads again
(profiled on a mixed run: the gather 20% and SDPA 14% of the time, the linear layers ~50%). Here
the step's decodes (one new token after a cached context) run as one call of
`native.paged_decode_attention`, which walks each sequence's block table once for the scores and
once for the values and pads nothing. Prefills and chunks keep the torch backend's grouped grids
(`torch_backend.plan_groups`); windows, softcapping, sinks and MLA widths are honoured by both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from keepwarm_runtime.engine.attention import native
from keepwarm_runtime.engine.attention.layer import KeepwarmAttention
from keepwarm_runtime.engine.attention.metadata import AttentionMetadata
from keepwarm_runtime.engine.attention.torch_backend import (
    TorchAttentionBackend,
    TorchGroup,
    attend_groups,
    build_group,
    plan_groups,
)
from keepwarm_runtime.engine.attention.window import Window


@dataclass
class DecodeBatch:
    """The step's decoding sequences, for the kernel: one query row each."""

    rows: torch.Tensor | None  # [Bd] packed row of each decode query; None: every row of the step
    block_tables: torch.Tensor  # [Bd, max_blocks] int32, contiguous
    ends: torch.Tensor  # [Bd] int64: context length (keys [start, end) are seen)
    positions: torch.Tensor  # [Bd] int64: the query's position (end - 1)
    prompt_lens: torch.Tensor  # [Bd] int64
    starts: dict[Window, torch.Tensor] = field(default_factory=dict)  # per window, made on first use

    def start(self, window: Window) -> torch.Tensor:
        if window not in self.starts:
            self.starts[window] = first_keys(self.positions, self.prompt_lens, window)
        return self.starts[window]


def first_keys(positions: torch.Tensor, prompt_lens: torch.Tensor, window: Window) -> torch.Tensor:
    """The first key each decode query sees: the torch backend's mask (`distance < window`) as a bound."""
    starts = torch.zeros_like(positions)
    for width, applies in (
        (window.prompt, positions < prompt_lens),
        (window.generated, positions >= prompt_lens),
    ):
        if width is not None:
            starts = torch.where(applies, (positions - width + 1).clamp(min=0), starts)
    return starts


@dataclass
class CpuStepMetadata:
    common: AttentionMetadata
    tokens: int  # T: packed queries in the step
    groups: list[TorchGroup]  # prefills and chunks, on the torch backend's grids
    decode: DecodeBatch | None


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, kernel_cache: str | None = None) -> None:
        # the node's build in kernel_cache, else built once on this machine; raises KernelUnavailable
        native.load(kernel_cache)

    @staticmethod
    def write_kv(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """index_copy_'s result by keepwarm's kernel: one copy per token instead of per element."""
        native.write_kv(cache, slots, rows)

    def build(self, meta: AttentionMetadata) -> CpuStepMetadata:
        qlens, ctx = meta.query_lens_list, meta.context_lens_list
        if meta.max_query_len == 1 and min(ctx) > 1:  # every sequence decodes: no groups to plan
            every = range(len(qlens))
            return CpuStepMetadata(meta, len(qlens), [], _decode_batch(meta, every, range(len(qlens) + 1)))
        plans = plan_groups(qlens, ctx)
        decodes = sorted(i for p in plans if p.max_query == 1 and not p.fresh for i in p.seqs)
        plans = [p for p in plans if p.max_query > 1 or p.fresh]
        starts = [0]
        for q in qlens:
            starts.append(starts[-1] + q)
        whole = len(plans) == 1 and not decodes
        groups = [build_group(meta, plan, starts, whole) for plan in plans]
        return CpuStepMetadata(meta, starts[-1], groups, _decode_batch(meta, decodes, starts))

    def graph_metadata(self, meta: AttentionMetadata, size: int) -> CpuStepMetadata:
        """A decode step padded to a graph bucket (engine/decode_graphs.py's CPU twin: no graph is
        captured on a CPU, the padded step is built and run like any other)."""
        return self.build(meta)

    def forward(
        self,
        layer: KeepwarmAttention,
        query: torch.Tensor,  # [1, H, T, Dk]
        key: torch.Tensor,  # [1, Hkv, T, Dk]
        value: torch.Tensor,  # [1, Hkv, T, Dv]
        step: CpuStepMetadata,
        scale: float,
        window: Window,
        softcap: float | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:  # [1, T, H, Dv]
        if step.decode is None:
            return super().forward(layer, query, key, value, step, scale, window, softcap, sinks)
        q = query[0].transpose(0, 1)  # [T, H, Dk]
        rows = step.decode.rows
        q_decode = q if rows is None else q.index_select(0, rows)
        decoded = _decode(layer, q_decode, step.decode, scale, window, softcap, sinks)
        if rows is None:  # every sequence of the step decodes
            return decoded.unsqueeze(0)
        out = decoded.new_empty(step.tokens, q.shape[1], decoded.shape[-1])
        out.index_copy_(0, rows, decoded)
        k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)
        attend_groups(out, layer, q, k, v, step.groups, scale, window, softcap, sinks)
        return out.unsqueeze(0)


def _decode_batch(meta: AttentionMetadata, seqs: Sequence[int], starts: Sequence[int]) -> DecodeBatch | None:
    if not seqs:
        return None
    device = meta.query_start.device
    if len(seqs) == len(meta.query_lens_list):  # one row per sequence, in step order
        rows = None
        tables, ends = meta.block_tables, meta.context_lens
        prompt_lens = meta.context_lens if meta.prompt_lens is None else meta.prompt_lens
    else:
        rows = torch.tensor([starts[i] for i in seqs], dtype=torch.long, device=device)
        index = torch.tensor(seqs, dtype=torch.long, device=device)
        tables, ends = meta.block_tables[index], meta.context_lens[index]
        prompt_lens = ends if meta.prompt_lens is None else meta.prompt_lens[index]
    return DecodeBatch(
        rows,
        tables.to(torch.int32).contiguous(),
        ends.long().contiguous(),
        ends.long() - 1,
        prompt_lens.long(),
    )


def _decode(
    layer: KeepwarmAttention,
    q: torch.Tensor,  # [Bd, H, Dk]
    decode: DecodeBatch,
    scale: float,
    window: Window,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:  # [Bd, H, Dv]
    cache_dtype = layer.k_cache.dtype
    out = q.new_empty(q.shape[0], q.shape[1], layer.v_cache.shape[-1], dtype=cache_dtype)
    native.paged_decode_attention(
        out,
        q.to(cache_dtype).contiguous(),
        layer.k_cache,
        layer.v_cache,
        decode.block_tables,
        decode.start(window),
        decode.ends,
        scale,
        softcap,
        None if sinks is None else sinks.float().contiguous(),
    )
    return out.to(q.dtype)
