"""Both sides of a tensor-parallel step: rank 0 shares it, ranks 1..N-1 follow.

Rank 0 runs the whole engine (scheduler, sampler, detokenizer, the server) with a ParallelRunner: a
ModelRunner that broadcasts each step's inputs (engine/parallel/step.py) just before its own forward
pass. Ranks 1..N-1 build the same engine (its model shard, attention and KV cache sized alike) and
then only ``follow``: receive a step, run the same forward pass (its collectives meet rank 0's),
discard the logits. rank 0's ``stop`` (an offline LLM's end) ends the loop; rank 0 dying ends it with
the collective's error, which is how a group goes down together.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from keepwarm_runtime.engine.attention.metadata import AttentionMetadata, use_metadata
from keepwarm_runtime.engine.model_runner import ModelRunner, text_logits
from keepwarm_runtime.engine.parallel.step import StepChannel

if TYPE_CHECKING:
    from keepwarm_runtime.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)


class ParallelRunner(ModelRunner):
    """Rank 0's runner: every step's inputs go to the other ranks before the forward pass."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.channel = StepChannel(self.device)

    def share(
        self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata, keep: torch.Tensor
    ) -> None:
        self.channel.send((ids, pos, meta, keep))


@torch.inference_mode()
def follow(engine: LLMEngine) -> int:
    """Run rank 0's steps until it says stop; returns how many ran."""
    channel = StepChannel(engine.device)
    steps = 0
    while (inputs := channel.receive()) is not None:
        ids, pos, meta, keep = inputs
        with use_metadata(meta):
            text_logits(engine.model, ids, pos, keep)
        steps += 1
    log.info("rank 0 stopped the group after %d steps", steps)
    return steps
