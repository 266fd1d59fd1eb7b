"""Torch and CPU attention backends against a naive per-sequence reference: mixed prefill/decode batches
with cached prefixes, GQA, MLA-style value width, sliding windows, softcapping and sinks, with the step
in one padded grid and split into many groups (the CPU backend's decodes run in its compiled kernel);
and how `plan_groups` splits a step."""

from __future__ import annotations

import math

import pytest
import torch

from keepwarm_runtime.engine.attention import torch_backend
from keepwarm_runtime.engine.attention.cpu_backend import CpuAttentionBackend
from keepwarm_runtime.engine.attention.layer import KeepwarmAttention
from keepwarm_runtime.engine.attention.metadata import AttentionMetadata, use_metadata
from keepwarm_runtime.engine.attention.torch_backend import TorchAttentionBackend, plan_groups

BS = 4  # block size


def naive(q, k, v, scale, window=None, softcap=None, sinks=None, prompt_len=None, generated_window=None):
    """q [Q, H, D] at the last Q positions of k/v [L, Hkv, D]; queries at or past `prompt_len` also
    see no further back than `generated_window`."""
    Q, H, _ = q.shape
    L, Hkv, _ = k.shape
    g = H // Hkv
    out = []
    for h in range(H):
        kh, vh = k[:, h // g], v[:, h // g]
        s = (q[:, h] @ kh.T) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        qpos = torch.arange(L - Q, L)[:, None]
        kpos = torch.arange(L)[None, :]
        allowed = kpos <= qpos
        if window:
            allowed &= qpos - kpos < window
        if generated_window:
            allowed &= (qpos < prompt_len) | (qpos - kpos < generated_window)
        s = s.masked_fill(~allowed, -math.inf)
        if sinks is not None:
            s = torch.cat([s, sinks[h].expand(Q, 1)], dim=1)
            p = torch.softmax(s, -1)[:, :-1]
        else:
            p = torch.softmax(s, -1)
        out.append(p @ vh)
    return torch.stack(out, 1)  # [Q, H, Dv]


# (cached tokens, new tokens) per sequence
STEPS = {
    "prefill": [(0, 5), (0, 1), (0, 7)],
    "mixed": [(5, 3), (9, 1), (0, 6)],  # a chunk after a prefix, a decode, a fresh prompt
    # decodes of many context lengths among chunks and fresh prompts, out of order
    "many": [(40, 1), (0, 9), (3, 1), (22, 6), (17, 1), (60, 1), (0, 2), (11, 12), (2, 1), (59, 1), (0, 1)],
    "decode": [(40, 1), (3, 1), (17, 1), (1, 1), (63, 1)],  # decodes only (the kernel takes every row)
}
BACKENDS = {"torch": TorchAttentionBackend, "cpu": CpuAttentionBackend}


@pytest.mark.parametrize(
    "window,softcap,use_sinks",
    [(None, None, False), (3, None, False), (None, 5.0, False), (None, None, True), (4, 30.0, True)],
)
@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("cache_window", [None, 2])  # generate()'s cache window: generated tokens only
@pytest.mark.parametrize("overhead", [0, 10**9])  # every sequence in its own group / one group per kind
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_paged_batch_matches_naive(
    window, softcap, use_sinks, step, cache_window, overhead, backend, monkeypatch
) -> None:
    monkeypatch.setattr(torch_backend, "GROUP_OVERHEAD_PAIRS", overhead)
    shapes = STEPS[step]
    prefill_only = all(cached == 0 for cached, _ in shapes)
    torch.manual_seed(0)
    H, Hkv, Dk, Dv = 4, 2, 8, 6
    layer = KeepwarmAttention(0, None, "Test")
    layer.backend = BACKENDS[backend]()
    layer.cache_window = cache_window
    num_blocks = 96
    layer.k_cache = torch.zeros(num_blocks, BS, Hkv, Dk)
    layer.v_cache = torch.zeros(num_blocks, BS, Hkv, Dv)
    free = list(range(num_blocks))[::-1]  # hand out blocks out of order on purpose
    seqs, slots, qs, ks, vs = [], [], [], [], []
    for cached, new in shapes:
        total = cached + new
        blocks = [free.pop() for _ in range(-(-total // BS))]
        k, v = torch.randn(total, Hkv, Dk), torch.randn(total, Hkv, Dv)
        for p in range(cached):  # earlier steps wrote these
            layer.k_cache[blocks[p // BS], p % BS] = k[p]
            layer.v_cache[blocks[p // BS], p % BS] = v[p]
        seqs.append((cached, new, blocks, k, v, torch.randn(new, H, Dk)))
        slots += [blocks[p // BS] * BS + p % BS for p in range(cached, total)]
        qs.append(seqs[-1][5])
        ks.append(k[cached:])
        vs.append(v[cached:])
    max_blocks = max(len(s[2]) for s in seqs)
    qlens = [s[1] for s in seqs]
    ctx = [s[0] + s[1] for s in seqs]
    # The last two positions were generated, except every third sequence's, all prompt (a recompute).
    prompt_lens = [max(1, c - 2) if i % 3 else c for i, c in enumerate(ctx)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start=torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32),
        query_lens=torch.tensor(qlens),
        context_lens=torch.tensor(ctx),
        block_tables=torch.tensor([s[2] + [0] * (max_blocks - len(s[2])) for s in seqs], dtype=torch.int32),
        max_query_len=max(qlens),
        max_context_len=max(ctx),
        block_size=BS,
        prefill_only=prefill_only,
        query_lens_list=qlens,
        context_lens_list=ctx,
        block_tables_list=[s[2] for s in seqs],
        prompt_lens=torch.tensor(prompt_lens),
        prompt_lens_list=prompt_lens,
    )
    sinks = torch.randn(H) if use_sinks else None
    scale = 0.3
    layer.scale = scale
    q = torch.cat(qs).transpose(0, 1)[None]  # [1, H, T, D] as transformers hands it over
    k = torch.cat(ks).transpose(0, 1)[None]
    v = torch.cat(vs).transpose(0, 1)[None]
    with use_metadata(meta):
        out = layer(q, k, v, window, softcap, sinks)[0]  # [T, H, Dv]
    start = 0
    generated_window = window if cache_window is None else min(cache_window, window or cache_window)
    for (_cached, new, _, k_all, v_all, q_seq), prompt_len in zip(seqs, prompt_lens, strict=True):
        want = naive(q_seq, k_all, v_all, scale, window, softcap, sinks, prompt_len, generated_window)
        torch.testing.assert_close(out[start : start + new], want, rtol=1e-5, atol=1e-5)
        start += new


def test_plan_groups_partitions_the_step_by_kind_and_length(monkeypatch) -> None:
    monkeypatch.setattr(torch_backend, "GROUP_MAX_KEYS", 10**9)
    # 63 decodes at two context lengths far apart, one long chunk, two fresh prompts
    qlens = [1] * 32 + [512] + [1] * 31 + [100, 98]
    ctx = [1000] * 32 + [1024] + [40] * 31 + [100, 98]
    plans = plan_groups(qlens, ctx)
    assert sorted(i for p in plans for i in p.seqs) == list(range(len(qlens)))  # each exactly once
    by_seqs = {p.seqs: p for p in plans}
    assert set(by_seqs) == {tuple(range(32)), (32,), tuple(range(33, 64)), (64, 65)}
    assert (by_seqs[(32,)].max_query, by_seqs[(32,)].max_keys, by_seqs[(32,)].fresh) == (512, 1024, False)
    assert (by_seqs[tuple(range(32))].max_query, by_seqs[tuple(range(32))].max_keys) == (1, 1000)
    assert (by_seqs[tuple(range(33, 64))].max_keys, by_seqs[(64, 65)].fresh) == (40, True)


def test_plan_groups_keeps_similar_decodes_together() -> None:
    plans = plan_groups([1] * 8, [500, 510, 520, 530, 505, 515, 525, 535])
    assert [p.seqs for p in plans] == [tuple(range(8))]
    assert plans[0].max_keys == 535


def test_plan_groups_caps_the_keys_a_group_gathers() -> None:
    plans = plan_groups([1] * 40, [1000] * 40)
    assert sorted(i for p in plans for i in p.seqs) == list(range(40))
    assert all(len(p.seqs) * p.max_keys <= torch_backend.GROUP_MAX_KEYS for p in plans)
    assert len(plans) == -(-40 * 1000 // torch_backend.GROUP_MAX_KEYS)
