"""ModelRunner: turns a SchedulerOutput into one packed forward pass and returns next-token logits.

It builds the step's AttentionMetadata from the scheduler's output (engine/step_inputs.py: array
operations into buffers kept between steps), and has the attention backend derive its own typed
metadata from it once (`backend.build`), before any layer runs. The lm head runs
only on the rows the step needs: each sequence's last known token, plus the prompt positions a
sequence scores for prompt logprobs (engine/prompt_logprobs.py); a step without the latter keeps
exactly one row per sampled sequence. With LoRA adapters (engine/lora) each token's adapter slot
is set around the pass, so one pass serves any mix of adapters and the base. A tensor-parallel rank
0 shares each step's inputs with the other ranks just before the pass (``share``:
engine/parallel/runner.py), which run the same ``text_logits``. With ``graphs`` set (CUDA:
engine/decode_graphs.py) a step where every sequence decodes one token and is sampled replays its
bucket's graph instead; any other step, or one the graphs turn down, runs eagerly. ``prepare`` and
``execute`` are a step's two halves: between them the engine finds the step's pending input tokens,
sampled by the step before and not yet landed (engine/overlap.py), which ``execute`` writes on the
device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from keepwarm_runtime.engine.attention.layer import KeepwarmAttention
from keepwarm_runtime.engine.attention.metadata import AttentionMetadata, use_metadata
from keepwarm_runtime.engine.decode_graphs import DecodeGraphs
from keepwarm_runtime.engine.lora import LoraSlots
from keepwarm_runtime.engine.lora.slots import use_step
from keepwarm_runtime.engine.multimodal import forward_with_embeds, place
from keepwarm_runtime.engine.prompt_logprobs import PromptChunk
from keepwarm_runtime.engine.scheduler import SchedulerOutput
from keepwarm_runtime.engine.sequence import Sequence
from keepwarm_runtime.engine.step_inputs import StepInputs, StepRows, StepTables


@dataclass
class StepLogits:
    sample_seqs: list[Sequence] = field(default_factory=list)  # sequences that get a new token
    logits: torch.Tensor | None = None  # [len(sample_seqs), vocab] float32, None when none
    prompt_chunks: list[PromptChunk] = field(default_factory=list)  # prompt positions scored this step
    prompt_logits: torch.Tensor | None = None  # [sum of chunk counts, vocab], rows in chunk order


class ModelRunner:
    def __init__(
        self, model: nn.Module, block_size: int, device: torch.device, lora: LoraSlots | None = None
    ):
        self.model = model
        self.lora = lora
        self.block_size = block_size
        self.device = device
        self._backend = None  # the attached layers' attention backend, found on the first step
        self.inputs = StepInputs(block_size, device)  # the step's host tables, in buffers kept between steps
        self.graphs: DecodeGraphs | None = None  # decode steps' CUDA graphs (LLMEngine.use_decode_graphs)

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

    def prepare(self, out: SchedulerOutput) -> StepTables:
        """The step's token ids, positions, attention metadata and kept rows (engine/step_inputs.py)."""
        return self.inputs.build(out)

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, tables: StepTables, pending: torch.Tensor | None = None
    ) -> StepLogits:
        """The step's forward pass on its prepared tables: logits of the sequences that get a new token,
        and of the prompt positions scored for prompt logprobs. ``pending``: the tokens of
        ``tables.pending_rows`` (on the device), sampled by a step not yet landed when the tables were
        made (engine/overlap.py)."""
        ids, pos, meta, rows = tables.input_ids, tables.positions, tables.metadata, tables.rows
        if pending is not None:
            at = tables.pending_rows
            if at[-1] == len(at) - 1:  # the first rows, as on most decode steps
                ids[: len(at)].copy_(pending)
            else:
                ids[torch.from_numpy(at).to(ids.device)] = pending
        if (logits := self._replayed(out, ids, pos, meta, rows)) is not None:
            return StepLogits(sample_seqs=rows.sample_seqs, logits=logits.float())
        keep = torch.from_numpy(rows.kept()).to(self.device)
        self.share(ids, pos, meta, keep)
        with use_metadata(meta), use_step(self._lora_step(out)):
            if any(seq.multimodal is not None for seq in out.seqs):
                logits = forward_with_embeds(self.model, self._embeds(out, ids), pos, keep)
            else:
                logits = text_logits(self.model, ids, pos, keep)
        if not (rows.sample_index or rows.prompt_index):
            return StepLogits()
        n = len(rows.sample_index)
        return StepLogits(
            sample_seqs=rows.sample_seqs,
            logits=logits[:n].float() if n else None,
            prompt_chunks=rows.prompt_chunks,
            prompt_logits=logits[n:] if rows.prompt_index else None,
        )

    def _replayed(
        self,
        out: SchedulerOutput,
        ids: torch.Tensor,
        pos: torch.Tensor,
        meta: AttentionMetadata,
        rows: StepRows,
    ) -> torch.Tensor | None:
        """The step's logits from its bucket's graph, when it is a decode step the graphs take (the
        engine gives no graphs to models with LoRA adapters or multimodal inputs)."""
        if (
            self.graphs is None
            or meta.max_query_len != 1
            or len(rows.sample_index) != len(out.seqs)  # a one-token prompt chunk before the last
            or rows.prompt_index
        ):
            return None
        return self.graphs.run(ids, pos, meta)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """A text pass over this runner's model (what the decode graphs capture)."""
        return text_logits(self.model, ids, pos, keep)

    def share(
        self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata, keep: torch.Tensor
    ) -> None:
        """Hand the step's inputs to the other processes that run it: the ranks of a tensor-parallel
        group (engine/parallel/runner.py); one process has none."""

    def _lora_step(self, out: SchedulerOutput):
        """Each packed token's adapter slot (-1: the base), as the LoRA hooks read it; None without LoRA."""
        if self.lora is None or all(seq.lora_name is None for seq in out.seqs):
            return None
        slots = [self.lora.slot(seq.lora_name) for seq in out.seqs]
        return self.lora.step(
            [s for s, n in zip(slots, out.num_scheduled_tokens, strict=True) for _ in range(n)]
        )

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


def text_logits(model: nn.Module, ids: torch.Tensor, pos: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """One packed forward pass of a text model (attention metadata set by the caller): the logits of
    the ``keep`` rows."""
    result = model(input_ids=ids[None], position_ids=pos[None], use_cache=False, logits_to_keep=keep)
    logits = result.logits[0]
    if logits.shape[0] != keep.shape[0]:  # a model that ignores logits_to_keep (Qwen2-Audio)
        logits = logits[keep]
    return logits
