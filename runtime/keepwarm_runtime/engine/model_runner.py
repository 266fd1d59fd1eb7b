"""ModelRunner: turns a SchedulerOutput into one packed forward pass and returns next-token logits.

It builds the step's AttentionMetadata from the scheduler's host lists, and has the attention backend
derive its own typed metadata from it once (`backend.build`), before any layer runs.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from keepwarm_runtime.engine.attention.layer import KeepwarmAttention
from keepwarm_runtime.engine.attention.metadata import AttentionMetadata, use_metadata
from keepwarm_runtime.engine.multimodal import forward_with_embeds, place
from keepwarm_runtime.engine.scheduler import SchedulerOutput
from keepwarm_runtime.engine.sequence import Sequence


class ModelRunner:
    def __init__(self, model: nn.Module, block_size: int, device: torch.device):
        self.model = model
        self.block_size = block_size
        self.device = device
        self._backend = None  # the attached layers' attention backend, found on the first step

    def backend(self):
        """The one backend every attached layer uses: its build() runs once per step, for all layers."""
        if self._backend is None:
            backends = {
                id(m.backend): m.backend for m in self.model.modules() if isinstance(m, KeepwarmAttention)
            }
            if len(backends) != 1:
                raise RuntimeError(f"expected one attention backend for all layers, found {len(backends)}")
            self._backend = next(iter(backends.values()))
        return self._backend

    def prepare(
        self, out: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], list[Sequence]]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        context_lens: list[int] = []
        sample_index: list[int] = []
        sample_seqs: list[Sequence] = []
        for seq, n in zip(out.seqs, out.num_scheduled_tokens, strict=True):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            blocks = seq.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            query_start.append(query_start[-1] + n)
            context_lens.append(end)
            if end == seq.num_tokens:  # the last known token is in: its logits give the next one
                sample_index.append(query_start[-1] - 1)
                sample_seqs.append(seq)
        prompt_lens = [seq.num_prompt_tokens for seq in out.seqs]
        query_lens = [e - s for s, e in itertools.pairwise(query_start)]
        max_blocks = max(len(seq.block_ids) for seq in out.seqs)
        tables = [seq.block_ids + [0] * (max_blocks - len(seq.block_ids)) for seq in out.seqs]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_start=torch.tensor(query_start, dtype=torch.int32, device=dev),
            query_lens=torch.tensor(query_lens, dtype=torch.long, device=dev),
            context_lens=torch.tensor(context_lens, dtype=torch.long, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            max_query_len=max(query_lens),
            max_context_len=max(context_lens),
            block_size=bs,
            prefill_only=all(c == q for c, q in zip(context_lens, query_lens, strict=True)),
            prompt_lens=torch.tensor(prompt_lens, dtype=torch.long, device=dev),
            prompt_lens_list=prompt_lens,
            query_lens_list=query_lens,
            context_lens_list=context_lens,
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        return ids, pos, meta, sample_index, sample_seqs

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> tuple[list[Sequence], torch.Tensor | None]:
        """Sequences that get a new token this step, and their logits [N, vocab] in float32."""
        ids, pos, meta, sample_index, sample_seqs = self.prepare(out)
        keep = torch.tensor(sample_index or [0], dtype=torch.long, device=self.device)
        if any(seq.multimodal is not None for seq in out.seqs):
            with use_metadata(meta):
                logits = forward_with_embeds(self.model, self._embeds(out, ids), pos, keep)
            return (sample_seqs, logits.float()) if sample_seqs else ([], None)
        with use_metadata(meta):
            result = self.model(
                input_ids=ids[None], position_ids=pos[None], use_cache=False, logits_to_keep=keep
            )
        if not sample_seqs:
            return [], None
        logits = result.logits[0]
        if logits.shape[0] != keep.shape[0]:  # a model that ignores logits_to_keep (Qwen2-Audio's LM)
            logits = logits[keep]
        return sample_seqs, logits.float()

    def _embeds(self, out: SchedulerOutput, ids: torch.Tensor) -> torch.Tensor:
        """The step's token embeddings with multimodal placeholders replaced (engine/multimodal.py)."""
        embeds = self.model.get_input_embeddings()(ids)
        offset = 0
        for seq, n in zip(out.seqs, out.num_scheduled_tokens, strict=True):
            if seq.multimodal is not None:
                start = seq.num_computed_tokens
                place(embeds[offset : offset + n], seq.multimodal, start, start + n)
            offset += n
        return embeds
