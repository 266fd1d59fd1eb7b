"""Sampler: logits of a batch of sequences -> one token each, with logprobs when asked.

Order per row, as in vLLM: penalties (repetition over prompt+output, presence/frequency over the
output), min_tokens masking of EOS/stop ids, the structured-output constraint's mask; then greedy
argmax, or temperature, top-k, top-p, min-p and a draw (exponential race, so seeded rows use their
own generator without a per-row multinomial). Logprobs are taken from the raw model distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from keepwarm_runtime.engine.outputs import Logprob
from keepwarm_runtime.engine.sequence import Sequence


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None  # the token's raw logprob, when the sequence asked for logprobs
    logprobs: dict[int, Logprob] | None  # sampled token + top alternatives (decoded_token filled later)


class Sampler:
    def __init__(self, eos_token_ids: set[int], seed: int = 0, device: torch.device | str = "cpu"):
        self.eos_token_ids = set(eos_token_ids)
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, seqs: list[Sequence], logits: torch.Tensor) -> list[SampledToken]:
        want_logprobs = [s.params.logprobs is not None for s in seqs]
        raw = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        logits = self._process(seqs, logits)
        tokens = self._choose(seqs, logits)
        out = []
        for row, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
            if not want_logprobs[row]:
                out.append(SampledToken(token, None, None))
                continue
            out.append(SampledToken(token, *_logprobs(raw[row], token, seq.params.logprobs)))
        return out

    def _process(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        touched = False
        for row, seq in enumerate(seqs):
            p = seq.params
            banned = []
            if seq.num_output_tokens < p.min_tokens:
                banned = [*self.eos_token_ids, *p.stop_token_ids]
            if not (p.needs_penalties or banned or seq.constraint is not None):
                continue
            if not touched:
                logits, touched = logits.clone(), True
            line = logits[row]
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=line.device)
                values = line[seen]
                line[seen] = torch.where(
                    values > 0, values / p.repetition_penalty, values * p.repetition_penalty
                )
            if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:
                out_ids = torch.tensor(seq.output_token_ids, dtype=torch.long, device=line.device)
                counts = torch.bincount(out_ids, minlength=line.shape[0])[: line.shape[0]].to(line.dtype)
                line -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(line.dtype)
            if banned:
                line[torch.tensor([t for t in banned if 0 <= t < line.shape[0]], dtype=torch.long)] = float(
                    "-inf"
                )
            if seq.constraint is not None:
                seq.constraint.fill_mask(line)
        return logits

    def _choose(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        tokens = logits.argmax(dim=-1).tolist()
        rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if not rows:
            return tokens
        sub = logits[rows]
        params = [seqs[i].params for i in rows]
        temps = torch.tensor([p.temperature for p in params], dtype=sub.dtype, device=sub.device)
        sub = sub / temps[:, None]
        if any(p.top_k > 0 for p in params) or any(p.top_p < 1.0 for p in params):
            sub = _top_k_top_p(sub, params)
        if any(p.min_p > 0 for p in params):
            probs = torch.softmax(sub, dim=-1)
            min_p = torch.tensor([p.min_p for p in params], dtype=sub.dtype, device=sub.device)
            sub = sub.masked_fill(
                probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, float("-inf")
            )
        probs = torch.softmax(sub, dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for j, i in enumerate(rows):
            gen = seqs[i].generator
            if gen is not None:
                noise[j].exponential_(generator=gen)
        chosen = (probs / noise).argmax(dim=-1).tolist()
        for j, i in enumerate(rows):
            tokens[i] = chosen[j]
        return tokens


def _top_k_top_p(logits: torch.Tensor, params) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ks = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=logits.device)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= ks[:, None]
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=logits.device)
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
    drop |= before > top_p[:, None]
    drop[:, 0] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _logprobs(raw: torch.Tensor, token: int, top: int) -> tuple[float, dict[int, Logprob]]:
    value = raw[token].item()
    rank = int((raw > raw[token]).sum().item()) + 1
    result = {token: Logprob(value, rank)}
    if top:
        values, ids = raw.topk(top)
        for r, (v, t) in enumerate(zip(values.tolist(), ids.tolist(), strict=True), start=1):
            result.setdefault(t, Logprob(v, r))
    return value, result
