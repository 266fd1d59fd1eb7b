"""Reference attention backend in plain torch (CPU and GPU): variable-length attention over the paged cache.

`build()` runs once per forward pass (the model runner calls it). It splits the step's sequences into
groups (`plan_groups`, a pure function) and returns a TorchStepMetadata holding, per group, where each
of its packed queries goes in a [B, Q] grid and which cache blocks hold each sequence's [L] keys. One
padded grid for the whole step would pay for the longest context in every row and, in a step that
mixes decodes with a prefill chunk, for the longest chunk's queries in every sequence (one 512-token
chunk beside 63 decodes makes a [64, H, 512, L] grid); groups of similar query and context lengths
keep the padding small. The boolean masks (causal, context length, windows) are made on first use per
group and distinct window and kept for the other layers. Each layer (which has written its new K/V
into the cache) then, per group, gathers with one index and runs SDPA (or an explicit softmax when
softcapping or sinks are needed). A group of prefills without cached tokens skips the gather and
attends to the new K/V directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from keepwarm_runtime.engine.attention.layer import KeepwarmAttention, write_kv
from keepwarm_runtime.engine.attention.metadata import AttentionMetadata
from keepwarm_runtime.engine.attention.window import Window

# Rough per-group cost, in query-key pairs, of one more attention call per layer (index, gather and
# SDPA launches), and of gathering one key position compared with scoring one pair: a group is worth
# starting when the padding it saves costs more than this. Measured on CPU (100M Llama, bf16): a
# group's fixed cost is about that of gathering ~128 key positions, and a gathered key costs about as
# much as scoring 8 query-key pairs.
GROUP_OVERHEAD_PAIRS = 1024
GATHER_PAIRS_PER_KEY = 8
# At most this many gathered key positions (B * L) per group: a group's gathered keys and values stay
# small enough to be read back from the CPU caches by SDPA (64 decodes with ~800 keys each in one
# gather took 3.7x as long as the same in four groups of similar length on this machine).
GROUP_MAX_KEYS = 8192


@dataclass(frozen=True)
class GroupPlan:
    """Sequences (indices into the step, in step order) that share one padded [B, Q, L] grid."""

    seqs: tuple[int, ...]
    max_query: int  # Q: the longest query among them
    max_keys: int  # L: the longest context among them
    fresh: bool  # none has cached tokens: attend to the new K/V directly, no gather


def plan_groups(query_lens: list[int], context_lens: list[int]) -> list[GroupPlan]:
    """Split a step's sequences into groups that each pad to their own longest query and context.

    Fresh prefills (no cached tokens), decodes (one query) and chunks (several queries after a cached
    prefix) are grouped apart; within each kind, sequences sorted by context length (then query
    length), longest first, join the open group while padding them costs less than a group of their
    own (`_grid_cost`), so decodes form buckets of similar context and a long chunk gets its own grid.
    """
    kinds: dict[str, list[int]] = {"fresh": [], "decode": [], "chunk": []}
    for i, (q, c) in enumerate(zip(query_lens, context_lens, strict=True)):
        kinds["fresh" if q == c else "decode" if q == 1 else "chunk"].append(i)
    plans = []
    for kind, members in kinds.items():
        fresh = kind == "fresh"
        members.sort(key=lambda i: (-context_lens[i], -query_lens[i], i))
        open_: list[int] = []
        q_max = l_max = 0  # the open group's longest query and context
        for i in members:
            q, c = query_lens[i], context_lens[i]
            if open_ and not _worth_joining(len(open_), q_max, l_max, q, c, fresh):
                plans.append(GroupPlan(tuple(sorted(open_)), q_max, l_max, fresh))
                open_, q_max, l_max = [], 0, 0
            open_.append(i)
            q_max, l_max = max(q_max, q), max(l_max, c)
        if open_:
            plans.append(GroupPlan(tuple(sorted(open_)), q_max, l_max, fresh))
    return plans


def _grid_cost(n: int, q: int, l: int, fresh: bool) -> int:  # noqa: E741
    return GROUP_OVERHEAD_PAIRS + n * l * (q + (0 if fresh else GATHER_PAIRS_PER_KEY))


def _worth_joining(n: int, q_max: int, l_max: int, q: int, c: int, fresh: bool) -> bool:
    """Whether a sequence (q queries, c context) joins a group of n with the given longest ones."""
    if not fresh and (n + 1) * max(l_max, c) > GROUP_MAX_KEYS:
        return False
    joined = _grid_cost(n + 1, max(q_max, q), max(l_max, c), fresh)
    return joined <= _grid_cost(n, q_max, l_max, fresh) + _grid_cost(1, q, c, fresh)


@dataclass
class TorchGroup:
    plan: GroupPlan
    rows: torch.Tensor | None  # [Tg] packed rows of the group's queries; None: the whole step, in order
    query_lens: torch.Tensor  # [B] new tokens per sequence of the group
    context_lens: torch.Tensor  # [B]
    prompt_lens: torch.Tensor  # [B]
    dense: bool  # every sequence has Q new tokens: the packed rows reshape to the grid as they are
    q_dest: torch.Tensor | None  # [Tg] grid row (b * Q + i) of each of the group's queries; None when dense
    kv_blocks: torch.Tensor | None  # [B, ceil(L / block_size)] block ids of each sequence; None: fresh
    q_pos: torch.Tensor  # [B, Q] absolute position of each grid query
    k_pos: torch.Tensor  # [L] key positions
    lone_fresh: bool | None  # one fresh sequence: whether it is all prompt (None: not one fresh sequence)
    masks: dict[Window, torch.Tensor | None] = field(default_factory=dict)  # [B, 1, Q, L] per window

    @property
    def batch(self) -> int:
        return len(self.plan.seqs)

    @property
    def max_query(self) -> int:
        return self.plan.max_query

    @property
    def max_keys(self) -> int:
        return self.plan.max_keys


@dataclass
class TorchStepMetadata:
    common: AttentionMetadata
    tokens: int  # T: packed queries in the step
    groups: list[TorchGroup]


class TorchAttentionBackend:
    name = "torch"
    write_kv = staticmethod(write_kv)  # the step's new keys and values into the cache (attention/layer.py)

    def check_layer(self, layer: KeepwarmAttention) -> None:
        """Every layer the fuser attaches runs here: windows, softcapping, sinks, MLA widths."""

    def build(self, meta: AttentionMetadata) -> TorchStepMetadata:
        """The step's groups, their grids and gather indices, once for every layer."""
        qlens, ctx = meta.query_lens_list, meta.context_lens_list
        plans = plan_groups(qlens, ctx)
        starts = [0]
        for q in qlens:
            starts.append(starts[-1] + q)
        groups = [build_group(meta, plan, starts, whole=len(plans) == 1) for plan in plans]
        return TorchStepMetadata(meta, starts[-1], groups)

    def forward(
        self,
        layer: KeepwarmAttention,
        query: torch.Tensor,  # [1, H, T, Dk]
        key: torch.Tensor,  # [1, Hkv, T, Dk]
        value: torch.Tensor,  # [1, Hkv, T, Dv]
        step: TorchStepMetadata,
        scale: float,
        window: Window,
        softcap: float | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:  # [1, T, H, Dv]
        q = query[0].transpose(0, 1)  # [T, H, Dk]
        k = key[0].transpose(0, 1)
        v = value[0].transpose(0, 1)
        if len(step.groups) == 1:
            return group_attention(layer, q, k, v, step.groups[0], scale, window, softcap, sinks)[None]
        out = q.new_empty(step.tokens, q.shape[1], v.shape[-1])
        attend_groups(out, layer, q, k, v, step.groups, scale, window, softcap, sinks)
        return out.unsqueeze(0)


def attend_groups(
    out: torch.Tensor,  # [T, H, Dv]: each group's rows are written
    layer: KeepwarmAttention,
    q: torch.Tensor,  # [T, H, Dk] the step's packed queries
    k: torch.Tensor,  # [T, Hkv, Dk] their new keys
    v: torch.Tensor,
    groups: list[TorchGroup],  # each with its rows (none covers the whole step)
    scale: float,
    window: Window,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> None:
    for group in groups:
        qg = q.index_select(0, group.rows)
        kg = vg = None
        if group.kv_blocks is None:
            kg, vg = k.index_select(0, group.rows), v.index_select(0, group.rows)
        out.index_copy_(
            0, group.rows, group_attention(layer, qg, kg, vg, group, scale, window, softcap, sinks)
        )


def build_group(meta: AttentionMetadata, plan: GroupPlan, starts: list[int], whole: bool) -> TorchGroup:
    device = meta.query_start.device
    qlens = [meta.query_lens_list[i] for i in plan.seqs]
    B, Q, L = len(plan.seqs), plan.max_query, plan.max_keys
    rows = None
    if not whole:
        rows = torch.tensor(
            [r for i in plan.seqs for r in range(starts[i], starts[i + 1])], dtype=torch.long, device=device
        )
    if whole:
        index = None
        query_lens, context_lens = meta.query_lens, meta.context_lens
        prompt_lens = meta.context_lens if meta.prompt_lens is None else meta.prompt_lens
        tables = meta.block_tables
    else:
        index = torch.tensor(plan.seqs, dtype=torch.long, device=device)
        query_lens, context_lens = meta.query_lens[index], meta.context_lens[index]
        prompt_lens = context_lens if meta.prompt_lens is None else meta.prompt_lens[index]
        tables = meta.block_tables[index]
    dense = all(n == Q for n in qlens)
    q_dest = None
    if not dense:
        dest = [j * Q + r for j, n in enumerate(qlens) for r in range(n)]
        q_dest = torch.tensor(dest, dtype=torch.long, device=device)
    kv_blocks = None if plan.fresh else tables[:, : -(-L // meta.block_size)].long()
    q_pos = (context_lens - query_lens)[:, None] + torch.arange(Q, device=device)
    first = plan.seqs[0]
    prompt_only = (
        meta.prompt_lens_list is None or meta.context_lens_list[first] <= meta.prompt_lens_list[first]
    )
    return TorchGroup(
        plan,
        rows,
        query_lens,
        context_lens,
        prompt_lens,
        dense,
        q_dest,
        kv_blocks,
        q_pos,
        torch.arange(L, device=device),
        lone_fresh=prompt_only if B == 1 and plan.fresh else None,
    )


def group_attention(
    layer: KeepwarmAttention,
    q: torch.Tensor,  # [Tg, H, Dk] the group's packed queries
    k: torch.Tensor | None,  # [Tg, Hkv, Dk] their new keys (used by a fresh group)
    v: torch.Tensor | None,
    group: TorchGroup,
    scale: float,
    window: Window,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:  # [Tg, H, Dv]
    num_heads = q.shape[1]
    B, Q = group.batch, group.max_query
    if group.kv_blocks is None:
        keys, values = _pad(k, group), _pad(v, group)  # [B, Q, Hkv, D]
    else:
        keys, values = _gather(layer.k_cache, group), _gather(layer.v_cache, group)  # [B, L, Hkv, D]
    num_kv = keys.shape[2]
    q_grid = _pad(q, group).transpose(1, 2)  # [B, H, Q, Dk]
    keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [B, Hkv, L, D]
    if window not in group.masks:
        group.masks[window] = _mask(group, window)
    mask = group.masks[window]  # [B, 1, Q, L] or None (plain causal)

    if softcap or sinks is not None:
        out = _explicit_attention(q_grid, keys, values, mask, scale, softcap, sinks)
    elif mask is None:
        out = F.scaled_dot_product_attention(
            q_grid, keys, values, is_causal=True, scale=scale, enable_gqa=num_heads != num_kv
        )
    elif Q == 1 and num_heads != num_kv:
        # One query per sequence: the heads sharing a KV head become that KV head's query rows, so
        # SDPA needs no GQA expansion of the keys; the [B, 1, 1, L] mask serves every row.
        rows = q_grid.reshape(B, num_kv, num_heads // num_kv, -1)
        out = F.scaled_dot_product_attention(rows, keys, values, attn_mask=mask, scale=scale)
        out = out.reshape(B, num_heads, 1, -1)
    else:
        out = F.scaled_dot_product_attention(
            q_grid, keys, values, attn_mask=mask, scale=scale, enable_gqa=num_heads != num_kv
        )
    out = out.transpose(1, 2).reshape(B * Q, num_heads, -1)  # [B*Q, H, Dv]
    if group.q_dest is not None:
        out = out[group.q_dest]
    return out


def _gather(cache: torch.Tensor, group: TorchGroup) -> torch.Tensor:
    """[num_blocks, block_size, Hkv, D] cache -> each sequence's first L keys, [B, L, Hkv, D].

    Whole blocks are copied (one index per block, not per token: measured ~1.7x faster for a decode
    step's gather on CPU) by ``index_select`` over the flat block list (faster than advanced indexing
    with the 2-D index on CPU: 35 vs 52 ms for 64 x 1536 bf16 keys), and the tail past L is sliced
    off as a view."""
    B, nblk = group.kv_blocks.shape
    blocks = cache.index_select(0, group.kv_blocks.view(-1))  # [B * nblk, block_size, Hkv, D]
    return blocks.view(B, nblk * cache.shape[1], *cache.shape[2:])[:, : group.max_keys]


def _pad(x: torch.Tensor, group: TorchGroup) -> torch.Tensor:
    """The group's packed [Tg, heads, D] -> [B, Q, heads, D] (rows past a sequence's length are zero)."""
    B, Q = group.batch, group.max_query
    if group.q_dest is None:
        return x.reshape(B, Q, *x.shape[1:])
    grid = x.new_zeros(B * Q, *x.shape[1:])
    grid[group.q_dest] = x
    return grid.view(B, Q, *x.shape[1:])


def _mask(group: TorchGroup, window: Window) -> torch.Tensor | None:
    q_pos, k_pos = group.q_pos, group.k_pos
    if group.lone_fresh is not None and _plain_causal(group.max_query, window, group.lone_fresh):
        return None  # one fresh sequence: plain causal attention
    allowed = k_pos[None, None, :] <= q_pos[:, :, None]  # causal, in absolute positions
    allowed &= (k_pos[None, :] < group.context_lens[:, None])[:, None, :]
    distance = q_pos[:, :, None] - k_pos[None, None, :]
    if window.prompt is not None:
        allowed &= distance < window.prompt
    if window.generated != window.prompt:
        in_prompt = (q_pos < group.prompt_lens[:, None])[:, :, None]  # [B, Q, 1]
        allowed &= in_prompt | (distance < window.generated)
    if not group.dense:
        padding_rows = (
            torch.arange(group.max_query, device=q_pos.device)[None, :] >= group.query_lens[:, None]
        )
        allowed[..., 0] |= padding_rows  # padded query rows see one key instead of none (no NaNs)
    return allowed.unsqueeze(1)


def _plain_causal(num_queries: int, window: Window, prompt_only: bool) -> bool:
    """One fresh sequence whose every query sees all earlier keys."""
    return all(
        w is None or w >= num_queries for w in (window.prompt, None if prompt_only else window.generated)
    )


def _explicit_attention(q, k, v, mask, scale, softcap, sinks) -> torch.Tensor:
    """Eager attention with tanh logit softcapping and/or per-head sink logits (Gemma 2, gpt-oss)."""
    B, H, Q, _ = q.shape
    Hkv = k.shape[1]
    g = H // Hkv
    qg = q.reshape(B, Hkv, g, Q, -1)
    scores = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2)) * scale  # [B, Hkv, g, Q, L]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        L = k.shape[2]
        mask = torch.ones(Q, L, dtype=torch.bool, device=q.device).tril(L - Q)[None, None]
    scores = scores.masked_fill(~mask.unsqueeze(2), float("-inf"))
    if sinks is not None:
        sink = sinks.to(scores.dtype).reshape(1, Hkv, g, 1, 1).expand(B, Hkv, g, Q, 1)
        scores = torch.cat([scores, sink], dim=-1)
        scores = scores - scores.max(dim=-1, keepdim=True).values
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, v.unsqueeze(2))  # [B, Hkv, g, Q, Dv]
    return out.reshape(B, H, Q, -1)
