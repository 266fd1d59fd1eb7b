"""Overlapped steps (vLLM's async scheduling): step N+1 is launched before step N's tokens are landed.

Without it a step is strictly in turn: schedule, make the tables, run the model, sample, read the
tokens back, then append them, check stops, detokenise and build outputs, and only then schedule the
next. On a GPU whose decode step replays a CUDA graph in a fraction of a millisecond, that host work
is most of the step and the device waits through it.

With it, ``LLMEngine.step`` schedules step N+1 and launches its pass (and its sampling) while step N's
tokens are still on their way to the host, then lands N (appends, stops, text, outputs) while the
device runs N+1. What makes that possible:

- A sequence sampled by a step not yet landed has a pending token (``Sequence.num_pending``): the
  scheduler counts it in the sequence's length, so its next decode is scheduled before the token is
  known; the step's tables hold a stand-in in its place, overwritten on the device with the token
  step N sampled (``ModelRunner.execute``'s ``pending``: no round trip through the host).
- A step's tokens count as computed once it is launched (the device runs steps in order), but a block
  enters the prefix cache only once its tokens are all known (``Scheduler.cache_landed``).
- A sequence that finishes on step N by a stop (EOS, a stop token or string) was already scheduled for
  N+1: that row is computed and dropped (its key and value are those of its real last token, so the
  cache holds nothing wrong). One whose token from N is its last by max_tokens is not scheduled for
  N+1 (``Sequence.ends_when_pending_lands``). Preempted or aborted meanwhile, it gets its token or is
  skipped when N lands.

Only steps whose sampling reads nothing that landing the step before changes run ahead: every
sampled sequence ``samples_ahead`` (no penalties, bad words, min_tokens or constraint) and no prompt
logprobs. Any other step is landed at once, as before. A batch of plain greedy rows is sampled on the
device (the argmax, copied back without waiting); any other batch takes the full sampler, which reads
its result back before the next step is launched.

On a CPU a step's pass runs where it is launched, so nothing overlaps and a token would only reach
its client a step later: steps run one at a time there unless ``async_scheduling`` is set (the CPU
twin, which runs this same loop in CI). A worker thread for the pass was tried on CPU and was slower
(docs/performance.md: the GIL and the hand-over cost more than the host's share it hid).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from keepwarm_runtime.engine.model_runner import StepLogits
from keepwarm_runtime.engine.sampler import SampledToken, argmax_rows
from keepwarm_runtime.engine.sequence import Sequence


@dataclass(slots=True)
class AheadTokens:
    """A step's sampled tokens, one per sampled sequence: on the device for the next step to read,
    and on their way to the host for landing."""

    device: torch.Tensor  # [B] int64, every id in the vocabulary (a failed row reads 0)
    host: torch.Tensor | list[int]  # a pinned copy being made (CUDA), or the tokens themselves
    copied: torch.cuda.Event | None = None  # recorded after the copy to ``host``
    sampled: list[SampledToken] | None = None  # the full sampler's output (logprobs, errors)

    def tolist(self) -> list[int]:
        if self.copied is not None:
            self.copied.synchronize()
        return self.host if isinstance(self.host, list) else self.host.tolist()


@dataclass(slots=True)
class Launched:
    """A step whose pass has been launched, to be landed: its tokens appended, stops checked."""

    step: StepLogits
    tokens: AheadTokens | None = None  # sampled at launch (it ran ahead); None: sampled when it lands


def greedy_ahead(logits: torch.Tensor) -> AheadTokens:
    """Each row's argmax, left on the device, its copy to the host begun (CUDA) or made (CPU)."""
    if logits.device.type == "cpu":
        tokens = argmax_rows(logits)
        return AheadTokens(torch.tensor(tokens, dtype=torch.long), tokens)
    device = logits.argmax(dim=-1)
    host = torch.empty(device.shape, dtype=device.dtype, pin_memory=True)
    host.copy_(device, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return AheadTokens(device, host, copied)


def sampled_ahead(sampled: list[SampledToken], device: torch.device) -> AheadTokens:
    """The full sampler's tokens (already on the host); a failed row (-1) reads token 0 in the next
    step, which is dropped when its request fails on landing."""
    tokens = [t.token_id for t in sampled]
    ids = torch.tensor([max(t, 0) for t in tokens], dtype=torch.long).to(device, non_blocking=True)
    return AheadTokens(ids, tokens, sampled=sampled)


def sources_of(pending_seqs: np.ndarray, seqs: list[Sequence], running: list[Sequence]) -> np.ndarray | None:
    """For each sequence of ``seqs`` at ``pending_seqs`` (its token is pending), its row among the
    sampled sequences of the step not yet landed (``running``); None when they are those rows in order,
    as on most steps (the same sequences decoding again in the same order)."""
    n = len(pending_seqs)
    if n == len(running) and (n == 0 or pending_seqs[-1] == n - 1) and seqs[:n] == running:
        return None
    row = {id(seq): r for r, seq in enumerate(running)}
    return np.fromiter((row[id(seqs[b])] for b in pending_seqs.tolist()), np.int64, n)
