"""Scheduler: token-count scheduling, batching limits, chunked prefill and preemption, without tensors."""

from __future__ import annotations

from keepwarm_runtime.engine.block_manager import BlockManager
from keepwarm_runtime.engine.sampling_params import SamplingParams
from keepwarm_runtime.engine.scheduler import Scheduler
from keepwarm_runtime.engine.sequence import Sequence, SequenceStatus


def make(num_blocks=64, block_size=4, max_num_seqs=8, max_tokens=64, prefix=True) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size, prefix), max_num_seqs, max_tokens)


def add(s: Scheduler, n_tokens: int, rid: str, start: int = 0) -> Sequence:
    q = Sequence(rid, 0, list(range(start, start + n_tokens)), SamplingParams())
    s.add(q)
    return q


def step(s: Scheduler, sample: bool = True) -> dict[str, int]:
    """One scheduler step; sequences whose prompt is done get a fake sampled token."""
    out = s.schedule()
    s.update_after_step(out)
    if sample:
        for q in out.seqs:
            if q.num_computed_tokens == q.num_tokens:
                q.token_ids.append(7)
    return {q.request_id: n for q, n in zip(out.seqs, out.num_scheduled_tokens, strict=True)}


def test_prefill_then_one_token_decodes() -> None:
    s = make()
    add(s, 10, "a")
    add(s, 5, "b")
    assert step(s) == {"a": 10, "b": 5}
    assert step(s) == {"a": 1, "b": 1}
    assert step(s) == {"a": 1, "b": 1}


def test_max_num_seqs_limits_the_running_batch() -> None:
    s = make(max_num_seqs=2)
    for i in range(3):
        add(s, 4, f"r{i}", start=100 * i)
    assert set(step(s)) == {"r0", "r1"}
    assert len(s.waiting) == 1
    s.finish(s.running[0])
    assert step(s) == {"r1": 1, "r2": 4}


def test_long_prompt_is_chunked_and_decodes_share_the_budget() -> None:
    s = make(max_tokens=8)
    add(s, 4, "short")
    assert step(s) == {"short": 4}
    add(s, 20, "long", start=1000)
    assert step(s) == {"short": 1, "long": 7}
    assert step(s) == {"short": 1, "long": 7}
    long = s.running[1]
    assert long.num_computed_tokens == 14 and long.num_output_tokens == 0
    assert step(s) == {"short": 1, "long": 6}
    assert long.num_output_tokens == 1  # prompt complete: sampled


def test_preemption_frees_the_newest_and_recomputes_it_later() -> None:
    s = make(num_blocks=4, block_size=4, prefix=False)
    a, b = add(s, 7, "a"), add(s, 7, "b", start=50)
    assert step(s) == {"a": 7, "b": 7}  # 2 blocks each: cache full
    assert step(s) == {"a": 1, "b": 1}  # position 7 still fits the second blocks
    out = step(s)  # both need a third block: b is preempted so a can go on
    assert out == {"a": 1}
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_ids == []
    assert s.num_preemptions == 1
    s.finish(a)
    assert a.block_ids == [] and s.block_manager.num_free_blocks == 4
    pending = b.num_tokens  # prompt + the token generated before preemption
    assert step(s) == {"b": pending}  # recomputed from scratch


def test_prefix_hit_starts_later() -> None:
    s = make(block_size=4)
    a = add(s, 9, "a")
    step(s)
    b = add(s, 9, "b")  # same tokens as a
    assert step(s) == {"a": 1, "b": 1}
    assert b.num_cached_tokens == 8 and b.block_ids[:2] == a.block_ids[:2]


def test_finish_frees_blocks_at_once() -> None:
    s = make(num_blocks=8)
    a = add(s, 10, "a")
    step(s)
    assert s.block_manager.num_free_blocks == 5
    s.finish(a)
    assert s.block_manager.num_free_blocks == 8 and not s.has_unfinished()


def test_a_scoring_sequence_takes_no_prefix_hits_and_its_own_budget(monkeypatch) -> None:
    from keepwarm_runtime.engine import scheduler as scheduler_module
    from keepwarm_runtime.engine.prompt_logprobs import positions_to_score

    monkeypatch.setattr(scheduler_module, "PROMPT_LOGITS_PER_STEP", 6)
    s = make()
    warm = add(s, 13, "warm")
    step(s)
    s.finish(warm)  # its three full blocks stay in the prefix cache
    scored = Sequence("scored", 0, list(range(13)), SamplingParams(prompt_logprobs=1))
    s.add(scored)
    plain = add(s, 13, "plain")
    out = s.schedule()
    assert dict(zip([q.request_id for q in out.seqs], out.num_scheduled_tokens, strict=True)) == {
        "scored": 6,  # from position 0, capped by the scoring budget
        "plain": 1,  # 12 tokens from the prefix cache
    }
    assert scored.num_cached_tokens == 0 and plain.num_cached_tokens == 12
    assert list(positions_to_score(scored, 0, 6)) == [0, 1, 2, 3, 4, 5]
    scored.prompt_logprobs.extend([{}] * 6)  # what the engine stores for those positions
    s.update_after_step(out)
    assert not scored.needs_prompt_logits or scored.num_computed_tokens == 6
    assert list(positions_to_score(scored, 6, 13)) == list(range(6, 12))
