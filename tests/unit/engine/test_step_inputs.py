"""The step's host tables (engine/step_inputs.py): values worked out by hand for mixed steps, and
buffers reused between steps without one step's tables leaking into another's."""

from __future__ import annotations

import numpy as np
import torch

from keepwarm_runtime.engine.sampling_params import SamplingParams
from keepwarm_runtime.engine.scheduler import SchedulerOutput
from keepwarm_runtime.engine.sequence import Sequence
from keepwarm_runtime.engine.step_inputs import StepInputs

BS = 4  # tokens per block


def seq(prompt: list[int], computed: int, blocks: list[int], generated: list[int] = (), **params) -> Sequence:
    s = Sequence("r", 0, prompt, SamplingParams(**params))
    s.token_ids.extend(generated)
    s.num_computed_tokens, s.block_ids = computed, list(blocks)
    return s


def step(*pairs: tuple[Sequence, int]) -> SchedulerOutput:
    return SchedulerOutput([s for s, _ in pairs], [n for _, n in pairs])


def test_a_mixed_step_packs_tokens_slots_and_tables_as_worked_out_by_hand() -> None:
    fresh = seq([11, 12, 13, 14, 15, 16], 0, [7, 3])  # a prompt's first chunk of 5 tokens
    decode = seq([21, 22, 23, 24, 25], 5, [2, 9], generated=[26])  # position 5, in block 9
    last_chunk = seq([31, 32, 33], 1, [5])  # its last 2 prompt tokens: sampled
    tables = StepInputs(BS, torch.device("cpu")).build(step((fresh, 5), (decode, 1), (last_chunk, 2)))
    meta = tables.metadata

    assert tables.input_ids.tolist() == [11, 12, 13, 14, 15, 26, 32, 33]
    assert tables.positions.tolist() == [0, 1, 2, 3, 4, 5, 1, 2]
    assert meta.slot_mapping.tolist() == [28, 29, 30, 31, 12, 37, 21, 22]
    assert meta.query_start.tolist() == [0, 5, 6, 8] and meta.query_start.dtype == torch.int32
    assert meta.query_lens.tolist() == [5, 1, 2] and meta.context_lens.tolist() == [5, 6, 3]
    assert meta.block_tables.tolist() == [[7, 3], [2, 9], [5, 0]] and meta.block_tables.dtype == torch.int32
    assert meta.prompt_lens.tolist() == [6, 5, 3] and meta.prompt_lens_list == [6, 5, 3]
    assert (meta.max_query_len, meta.max_context_len, meta.prefill_only) == (5, 6, False)
    assert meta.query_lens_list == [5, 1, 2] and meta.context_lens_list == [5, 6, 3]
    assert meta.block_tables_list == [[7, 3], [2, 9], [5]]
    # the fresh prompt's chunk ends before its last token: nothing sampled from it
    assert tables.rows.sample_index == [5, 7] and tables.rows.sample_seqs == [decode, last_chunk]
    assert tables.rows.prompt_index == [] and tables.rows.prompt_chunks == []


def test_an_all_decode_step_and_prompt_positions_scored_for_logprobs() -> None:
    a = seq([1, 2, 3], 3, [4], generated=[9])
    b = seq([5, 6, 7, 8, 1, 2], 6, [0, 8], generated=[3])
    tables = StepInputs(BS, torch.device("cpu")).build(step((a, 1), (b, 1)))
    assert tables.input_ids.tolist() == [9, 3] and tables.positions.tolist() == [3, 6]
    assert tables.metadata.slot_mapping.tolist() == [19, 34]
    assert tables.rows.sample_index == [0, 1]

    scoring = seq([40, 41, 42, 43, 44], 0, [1, 6], prompt_logprobs=1)
    tables = StepInputs(BS, torch.device("cpu")).build(step((a, 1), (scoring, 3)))
    # positions 0..2 score prompt tokens 1..3; rows 1..3 of the packed step
    assert tables.rows.prompt_index == [1, 2, 3]
    [chunk] = tables.rows.prompt_chunks
    assert (chunk.seq, chunk.first_position, chunk.count) == (scoring, 0, 3)
    assert tables.metadata.prefill_only is False and tables.rows.sample_seqs == [a]
    # the lm head's rows: sampled then scored, int64; row 0 alone when a step keeps none
    assert tables.rows.kept().tolist() == [0, 1, 2, 3] and tables.rows.kept().dtype == np.int64
    first_chunk = StepInputs(BS, torch.device("cpu")).build(step((seq([1, 2, 3, 4, 5], 0, [2, 3]), 2)))
    assert first_chunk.rows.sample_index == [] and first_chunk.rows.kept().tolist() == [0]


def test_a_step_s_tables_stay_intact_while_the_next_is_built_and_padding_never_goes_stale() -> None:
    inputs = StepInputs(BS, torch.device("cpu"))
    long = seq(list(range(1, 14)), 12, [1, 2, 3, 4])
    short = seq([7, 8], 1, [6])
    first = inputs.build(step((long, 1), (short, 1)))
    second = inputs.build(step((short, 1), (long, 1)))  # the other buffer set
    assert first.metadata.block_tables.tolist() == [[1, 2, 3, 4], [6, 0, 0, 0]]
    assert second.metadata.block_tables.tolist() == [[6, 0, 0, 0], [1, 2, 3, 4]]
    assert first.input_ids.tolist() == [13, 8] and second.input_ids.tolist() == [8, 13]
    # the third step reuses the first one's buffers: rows written for other sequences are zeroed
    third = inputs.build(step((seq([5], 0, [9]), 1), (seq([6, 6], 0, [8]), 2)))
    assert third.metadata.block_tables.tolist() == [[9], [8]]
    assert third.metadata.slot_mapping.tolist() == [36, 32, 33] and third.metadata.prefill_only


def test_buffers_grow_for_a_larger_step_and_keep_its_values() -> None:
    inputs = StepInputs(BS, torch.device("cpu"))
    small = inputs.build(step((seq([1, 2], 0, [3]), 2)))
    many = [seq([i, i + 1, i + 2], 0, [i]) for i in range(40)]
    big = inputs.build(step(*((s, 3) for s in many)))
    assert big.input_ids.tolist() == [t for i in range(40) for t in (i, i + 1, i + 2)]
    assert big.metadata.slot_mapping.tolist() == [i * BS + p for i in range(40) for p in range(3)]
    assert big.metadata.query_start.tolist() == list(range(0, 121, 3))
    assert small.input_ids.tolist() == [1, 2]  # the smaller step's tables were not overwritten


def test_decode_steps_of_the_same_sequences_rewrite_only_the_rows_whose_blocks_changed() -> None:
    """The block table kept from step to step (_BlockTable): a sequence that gains a block, a block
    table wider than any kept so far, another order of the same sequences and a sequence that leaves
    the batch all give the table worked out from the sequences themselves, and one-token-each steps
    after a mixed one have their own query starts and lengths."""
    inputs = StepInputs(BS, torch.device("cpu"))
    a = seq([1, 2, 3], 3, [4], generated=[9])  # position 3: the last slot of block 4
    b = seq([5, 6, 7, 8, 1, 2], 6, [0, 8], generated=[3])

    def decode(*seqs: Sequence) -> list[list[int]]:
        tables = inputs.build(step(*((s, 1) for s in seqs)))
        expected = [
            [*s.block_ids, *[0] * (tables.metadata.block_tables.shape[1] - len(s.block_ids))] for s in seqs
        ]
        assert tables.metadata.block_tables.tolist() == expected
        assert tables.input_ids.tolist() == [s.token_ids[s.num_computed_tokens] for s in seqs]
        assert tables.metadata.query_start.tolist() == list(range(len(seqs) + 1))
        assert tables.metadata.query_lens.tolist() == [1] * len(seqs)
        assert tables.metadata.slot_mapping.tolist() == [
            s.block_ids[s.num_computed_tokens // BS] * BS + s.num_computed_tokens % BS for s in seqs
        ]
        for s in seqs:  # as the scheduler and the engine leave them
            s.num_computed_tokens += 1
            s.token_ids.append(7)
        return tables.metadata.block_tables.tolist()

    assert decode(a, b) == [[4, 0], [0, 8]]
    a.block_ids.append(11)  # a's next token starts a block
    assert decode(a, b) == [[4, 11], [0, 8]]
    b.block_ids.append(12)  # and now b's
    a.block_ids += [13, 14, 15]  # wider than the table kept
    assert decode(a, b) == [[4, 11, 13, 14, 15], [0, 8, 12, 0, 0]]
    assert decode(b, a) == [[0, 8, 12, 0, 0], [4, 11, 13, 14, 15]]
    assert decode(b) == [[0, 8, 12]]
    mixed = inputs.build(step((seq([1, 2, 3], 0, [6]), 3), (seq([4, 5], 0, [7]), 2)))  # both buffer sets
    mixed = inputs.build(step((seq([1, 2, 3], 0, [6]), 3), (seq([4, 5], 0, [7]), 2)))
    assert mixed.metadata.query_start.tolist() == [0, 3, 5] and mixed.metadata.query_lens.tolist() == [3, 2]
    b.block_ids, b.num_computed_tokens = [2], 3  # freed, given a new list and recomputed
    assert decode(a, b) == [[4, 11, 13, 14, 15], [2, 0, 0, 0, 0]]
