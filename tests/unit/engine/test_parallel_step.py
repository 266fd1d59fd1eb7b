"""Rank 0's step inputs packed as integers for the other ranks: every AttentionMetadata field arrives
as it was sent, and a field of a kind the wire does not carry is refused by name when packed."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest
import torch

from keepwarm_runtime.engine.attention.metadata import AttentionMetadata
from keepwarm_runtime.engine.parallel.step import pack, unpack


def _meta() -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=torch.tensor([4, 5, 6, 17], dtype=torch.long),
        query_start=torch.tensor([0, 3, 4], dtype=torch.int32),
        query_lens=torch.tensor([3, 1], dtype=torch.long),
        context_lens=torch.tensor([3, 9], dtype=torch.long),
        block_tables=torch.tensor([[1, 0, 0], [2, 3, 4]], dtype=torch.int32),
        max_query_len=3,
        max_context_len=9,
        block_size=4,
        prefill_only=False,
        query_lens_list=[3, 1],
        context_lens_list=[3, 9],
        block_tables_list=[[1], [2, 3, 4]],
        prompt_lens=None,
        prompt_lens_list=[3, 5],
        backend_metadata=object(),  # each rank's backend builds its own
    )


def test_step_inputs_arrive_as_sent() -> None:
    meta = _meta()
    ids, pos, keep = torch.tensor([11, 12, 13, 14]), torch.tensor([0, 1, 2, 8]), torch.tensor([2, 3])
    got_ids, got_pos, got_meta, got_keep = unpack(pack(ids, pos, meta, keep), torch.device("cpu"))
    assert torch.equal(got_ids, ids) and torch.equal(got_pos, pos) and torch.equal(got_keep, keep)
    assert got_meta.backend_metadata is None
    for f in fields(AttentionMetadata):
        if f.name == "backend_metadata":
            continue
        want, got = getattr(meta, f.name), getattr(got_meta, f.name)
        if isinstance(want, torch.Tensor):
            assert got.dtype == want.dtype and torch.equal(got, want), f.name
        else:
            assert got == want and type(got) is type(want), f.name


def test_a_field_the_wire_does_not_carry_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="step input max_query_len: a float"):
        pack(torch.tensor([1]), torch.tensor([0]), replace(_meta(), max_query_len=1.5), torch.tensor([0]))
    with pytest.raises(TypeError, match=r"step input slot_mapping: tensors of torch\.float32"):
        pack(
            torch.tensor([1]),
            torch.tensor([0]),
            replace(_meta(), slot_mapping=torch.zeros(4)),
            torch.tensor([0]),
        )


def test_left_over_values_are_an_error() -> None:
    data = pack(torch.tensor([1]), torch.tensor([0]), _meta(), torch.tensor([0]))
    with pytest.raises(ValueError, match="1 values left over"):
        unpack(torch.cat([data, torch.tensor([7])]), torch.device("cpu"))
