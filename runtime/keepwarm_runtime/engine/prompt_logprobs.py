"""Prompt logprobs: how likely the model found each prompt token, scored chunk by chunk during prefill.

Position ``p``'s logits score prompt token ``p + 1``, so a sequence that asks (``prompt_logprobs``, or
completions' ``echo`` with ``logprobs``) keeps the logits of the prompt positions a step computes, next
to the rows it samples from. The scheduler caps those positions per step (``PROMPT_LOGITS_PER_STEP``),
so a long prompt costs a bounded [positions, vocab] block per step, never the whole prompt at once.
Entries are stored by position: a recomputation after preemption re-runs positions already scored and
they are skipped, not appended twice. Values come from the raw distribution (log-softmax of the
model's logits, before any penalty or mask), as vLLM reports them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from keepwarm_runtime.engine.outputs import Logprob
from keepwarm_runtime.engine.sequence import Sequence

# Prompt positions whose logits one step keeps for scoring (all sequences together): bounds the step's
# extra memory to PROMPT_LOGITS_PER_STEP x vocab floats (about 600 MiB in fp32 at a 152k vocabulary,
# with its log-softmax).
PROMPT_LOGITS_PER_STEP = 1024


@dataclass
class PromptChunk:
    seq: Sequence  # the sequence whose prompt tokens these rows score
    first_position: int  # position of the first row; it scores prompt token first_position + 1
    count: int  # consecutive positions (rows)


def positions_to_score(seq: Sequence, start: int, end: int) -> range:
    """The positions in this step's [start, end) whose logits score a prompt token not yet stored."""
    if seq.prompt_logprobs is None:
        return range(0)
    return range(max(start, len(seq.prompt_logprobs) - 1), min(end, seq.num_prompt_tokens - 1))


def score(logits: torch.Tensor, targets: list[int], top: int) -> list[dict[int, Logprob]]:
    """Per row of ``logits`` [rows, vocab]: the target token's logprob and rank, plus ``top`` alternatives."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(targets, dtype=torch.long, device=logprobs.device)[:, None]
    chosen = logprobs.gather(1, index)
    ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
    values = chosen[:, 0].tolist()
    entries = [{t: Logprob(v, r)} for t, v, r in zip(targets, values, ranks, strict=True)]
    if top:
        top_values, top_ids = logprobs.topk(min(top, logprobs.shape[1]), dim=1)
        for entry, row_values, row_ids in zip(entries, top_values.tolist(), top_ids.tolist(), strict=True):
            for rank, (v, t) in enumerate(zip(row_values, row_ids, strict=True), start=1):
                entry.setdefault(t, Logprob(v, rank))
    return entries


def store(chunk: PromptChunk, logits: torch.Tensor) -> list[dict[int, Logprob]]:
    """Score ``chunk``'s rows of ``logits`` and append them to its sequence; returns the new entries."""
    seq = chunk.seq
    assert seq.prompt_logprobs is not None and len(seq.prompt_logprobs) == chunk.first_position + 1
    targets = seq.prompt_token_ids[chunk.first_position + 1 : chunk.first_position + 1 + chunk.count]
    entries = score(logits, targets, seq.params.prompt_logprobs or 0)
    seq.prompt_logprobs.extend(entries)
    return entries
