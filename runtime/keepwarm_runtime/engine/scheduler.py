"""Scheduler: continuous batching by token counts (vLLM v1).

Every sequence's `num_computed_tokens` chases its `num_tokens`. Each step hands out a budget of
`max_num_batched_tokens`: running sequences first (a decode needs one token, an unfinished prefill its
next chunk), then waiting ones by priority (lower first), then arrival, while there is room for another
sequence. Prefix hits
and chunked prefill need no special mode: they just start a sequence at a later `num_computed_tokens`
or give it fewer tokens than it has left. When blocks run out the newest running sequence is
preempted: its blocks are freed and it is recomputed later from the start.

A sequence that scores its prompt (prompt logprobs, engine/prompt_logprobs.py) takes no prefix hits
until its prompt is scored, and its prefill chunks also come out of a second per-step budget,
``PROMPT_LOGITS_PER_STEP`` positions, which bounds the logits a step keeps for scoring.

A sequence with a LoRA adapter is admitted only once its adapter holds a slot (engine/lora/slots.py);
while every slot is pinned by other adapters it stays queued and the base-model sequences behind it
go ahead, but no later adapter sequence does (so pins drain and it gets the next slot: FCFS among
adapter requests). Running sequences pin their adapter's slot until they finish or are preempted.

While a step runs, the next may be scheduled (engine/overlap.py): a sequence's pending token (sampled
by the running step, ``num_pending``) counts towards its length, and the step's tokens count as
computed from when it is launched (later steps run after it). A block is registered in the prefix
cache only once its tokens are known as well (``cache_landed`` after the pending ones land). A
sequence whose pending token is its last by ``max_tokens`` is not scheduled again: that pass would be
dropped, and its block could cost another sequence a preemption.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from keepwarm_runtime.engine.block_manager import BlockManager
from keepwarm_runtime.engine.lora import LoraSlots
from keepwarm_runtime.engine.prompt_logprobs import PROMPT_LOGITS_PER_STEP
from keepwarm_runtime.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)  # batch order
    num_scheduled_tokens: list[int] = field(default_factory=list)  # tokens computed this step, per seq

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        lora: LoraSlots | None = None,
    ):
        self.block_manager = block_manager
        self.lora = lora
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue behind every waiting sequence of the same or a more urgent (lower) priority."""
        position = len(self.waiting)
        while position and self.waiting[position - 1].priority > seq.priority:
            position -= 1
        self.waiting.insert(position, seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scoring_budget = PROMPT_LOGITS_PER_STEP  # prompt positions kept for prompt logprobs
        preemptions = self.num_preemptions
        block_size = self.block_manager.block_size
        i = 0
        while i < len(self.running) and budget > 0:  # every running sequence, every step: plain locals
            seq = self.running[i]
            if seq.num_pending and seq.ends_when_pending_lands():  # no pass may follow its last token
                i += 1
                continue
            computed = seq.num_computed_tokens
            n = min(len(seq.token_ids) + seq.num_pending - computed, budget)
            scoring = seq.prompt_logprobs is not None and seq.needs_prompt_logits
            if scoring:
                n = min(n, scoring_budget)
                if n == 0:  # no scoring room left this step: it waits a step, keeping its blocks
                    i += 1
                    continue
            end = computed + n
            # Its blocks already hold the tokens on most decode steps (BlockManager.allocate's own test).
            if end > len(seq.block_ids) * block_size and not self._allocate_or_preempt(seq, end):
                continue
            out.seqs.append(seq)
            out.num_scheduled_tokens.append(n)
            budget -= n
            if scoring:
                scoring_budget -= n
            i += 1
        preempted = self.num_preemptions != preemptions
        index = 0  # sequences before it wait for an adapter slot
        lora_blocked = False  # an earlier adapter sequence found no slot: later ones wait behind it
        while (
            index < len(self.waiting)
            and budget > 0
            and len(self.running) < self.max_num_seqs
            and not preempted
        ):
            seq = self.waiting[index]
            scoring = seq.needs_prompt_logits
            if scoring and scoring_budget == 0:
                break
            if seq.lora_name is not None and (lora_blocked or not self.lora.acquire(seq.lora_name)):
                lora_blocked = True
                index += 1
                continue
            hits = [] if scoring else self.block_manager.find_cached_prefix(seq)
            num_computed = len(hits) * self.block_manager.block_size
            n = min(seq.num_tokens - num_computed, budget, scoring_budget if scoring else budget)
            if not self.block_manager.allocate(seq, num_computed + n, hits):
                self._unpin(seq)
                break
            del self.waiting[index]
            seq.num_computed_tokens = num_computed
            if seq.num_output_tokens == 0:
                seq.num_cached_tokens = num_computed
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.seqs.append(seq)
            out.num_scheduled_tokens.append(n)
            budget -= n
            scoring_budget -= n if scoring else 0
        return out

    def _allocate_or_preempt(self, seq: Sequence, num_tokens: int) -> bool:
        """Blocks for ``seq``'s first ``num_tokens`` tokens, preempting the newest running sequences
        until they fit; False when ``seq`` itself was preempted."""
        while not self.block_manager.allocate(seq, num_tokens):
            victim = self.running.pop()
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def update_after_step(self, out: SchedulerOutput) -> None:
        """The scheduled tokens are now in the KV cache."""
        block_size = self.block_manager.block_size
        for seq, n in zip(out.seqs, out.num_scheduled_tokens, strict=True):
            seq.num_computed_tokens += n
            # cache_full_blocks has nothing to do unless a block filled (most decode steps)
            if seq.num_computed_tokens // block_size > len(seq.block_hashes):
                self.block_manager.cache_full_blocks(seq)

    def cache_landed(self, seqs: list[Sequence]) -> None:
        """Register the blocks that the tokens just landed for ``seqs`` complete: their keys and values
        were computed (or are being, by a step launched before any that could read them)."""
        block_size = self.block_manager.block_size
        for seq in seqs:
            if seq.num_computed_tokens // block_size > len(seq.block_hashes):
                self.block_manager.cache_full_blocks(seq)

    def finish(self, seq: Sequence) -> None:
        """Free a finished or aborted sequence's blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._unpin(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self.block_manager.free(seq)

    def _unpin(self, seq: Sequence) -> None:
        if seq.lora_name is not None:
            self.lora.release(seq.lora_name)

    def _preempt(self, seq: Sequence) -> None:
        self._unpin(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
