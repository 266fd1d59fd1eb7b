"""Sampler: logits of a batch of sequences -> one token each, with logprobs when asked.

Order per row, as in vLLM: penalties (repetition over prompt+output, presence/frequency over the
output), logit_bias, allowed_token_ids, bad words, min_tokens masking of EOS/stop ids, the
structured-output constraint's mask; then greedy argmax, or temperature, top-k, top-p, min-p and a
draw (exponential race, so seeded rows use their own generator without a per-row multinomial).
Logprobs are taken from the raw model distribution.

A batch whose every row is plain greedy (``Sequence.plain_greedy``, no constraint) skips all of it:
``greedy_tokens`` is the argmax alone, with no per-row checks and no ``SampledToken`` per row, the
same tokens ``__call__`` gives (its general path makes no change to such rows).

Isolation: one request's fault (a constraint that raises, a parameter that overflows) must not cost
the other rows their step. Per-row work catches per row; the batched draw, if it raises, is redone
row by row. A failed row comes back as a ``SampledToken`` with ``error`` set and no token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from keepwarm_runtime.engine.outputs import Logprob
from keepwarm_runtime.engine.sequence import Sequence


@dataclass
class SampledToken:
    token_id: int  # -1 when the row failed
    logprob: float | None  # the token's raw logprob, when the sequence asked for logprobs
    logprobs: dict[int, Logprob] | None  # sampled token + top alternatives (decoded_token filled later)
    error: str | None = None  # why this row could not be sampled (its request fails, no one else's)


def _failure(exc: BaseException) -> str:
    return f"sampling failed: {type(exc).__name__}: {exc}"


class Sampler:
    def __init__(self, eos_token_ids: set[int], seed: int = 0, device: torch.device | str = "cpu"):
        self.eos_token_ids = set(eos_token_ids)
        self.generator = torch.Generator(device=device).manual_seed(seed)

    @staticmethod
    def all_plain_greedy(seqs: list[Sequence]) -> bool:
        """Whether the argmax alone serves every row (no ``SampledToken`` needed)."""
        return all(seq.plain_greedy and seq.constraint is None for seq in seqs)

    def greedy_tokens(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int] | None:
        """Every row's token when all rows are plain greedy with no constraint, else None (then
        ``__call__`` samples them). None too if the argmax raises, so ``__call__`` isolates the fault."""
        if not self.all_plain_greedy(seqs):
            return None
        try:
            return argmax_rows(logits)
        except Exception:
            return None

    def __call__(self, seqs: list[Sequence], logits: torch.Tensor) -> list[SampledToken]:
        want_logprobs = [s.params.logprobs is not None for s in seqs]
        raw = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        failed: dict[int, str] = {}  # row -> why
        logits = self._process(seqs, logits, failed)
        tokens = self._choose_isolated(seqs, logits, failed)
        asked = [r for r, want in enumerate(want_logprobs) if want and r not in failed]
        batched = (
            _batch_logprobs(raw, asked, tokens, [seqs[r].params.logprobs for r in asked]) if asked else {}
        )
        out = []
        for row, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
            if row in failed:
                out.append(SampledToken(-1, None, None, failed[row]))
            elif not want_logprobs[row]:
                out.append(SampledToken(token, None, None))
            elif row in batched:
                out.append(SampledToken(token, *batched[row]))
            else:
                try:
                    out.append(SampledToken(token, *_logprobs(raw[row], token, seq.params.logprobs)))
                except Exception as exc:
                    out.append(SampledToken(-1, None, None, _failure(exc)))
        return out

    def _process(
        self, seqs: list[Sequence], logits: torch.Tensor, failed: dict[int, str] | None = None
    ) -> torch.Tensor:
        """The processed logits (a copy when any row changes); rows that raise go into ``failed``."""
        failed = {} if failed is None else failed
        touched = False
        for row, seq in enumerate(seqs):
            p = seq.params
            banned = []
            if p.min_tokens and seq.num_output_tokens < p.min_tokens:
                banned = [*self.eos_token_ids, *p.stop_token_ids]
            if not (banned or seq.constraint is not None or p.needs_masks):
                continue
            if not touched:
                logits, touched = logits.clone(), True
            try:
                self._process_row(seq, logits[row], banned)
            except Exception as exc:
                failed[row] = _failure(exc)
                logits[row] = 0.0  # keep the batched draw finite; this row's token is discarded
        return logits

    @staticmethod
    def _process_row(seq: Sequence, line: torch.Tensor, banned: list[int]) -> None:
        """Apply one sequence's penalties, biases and masks to its logits row, in place."""
        p = seq.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=line.device)
            values = line[seen]
            line[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:
            out_ids = torch.tensor(seq.output_token_ids, dtype=torch.long, device=line.device)
            counts = torch.bincount(out_ids, minlength=line.shape[0])[: line.shape[0]].to(line.dtype)
            line -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(line.dtype)
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=line.device)
            bias = torch.tensor(list(p.logit_bias.values()), dtype=line.dtype, device=line.device)
            line.index_add_(0, ids, bias)
        if p.allowed_token_ids is not None:
            keep = torch.full_like(line, float("-inf"))
            keep[torch.tensor(p.allowed_token_ids, dtype=torch.long, device=line.device)] = 0.0
            line += keep
        banned = banned + _bad_word_tokens(seq.output_token_ids, p.bad_words_token_ids)
        if banned:
            ids = torch.tensor([t for t in banned if 0 <= t < line.shape[0]], dtype=torch.long)
            line[ids.to(line.device)] = float("-inf")
        if seq.constraint is not None:
            seq.constraint.fill_mask(line)

    def _choose_isolated(
        self, seqs: list[Sequence], logits: torch.Tensor, failed: dict[int, str]
    ) -> list[int]:
        """The batched draw; if it raises, each row alone, so only the faulty rows fail."""
        try:
            return self._choose(seqs, logits)
        except Exception:
            tokens = [-1] * len(seqs)
            for row, seq in enumerate(seqs):
                if row in failed:
                    continue
                try:
                    tokens[row] = self._choose([seq], logits[row : row + 1])[0]
                except Exception as exc:
                    failed[row] = _failure(exc)
            return tokens

    def _choose(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        """Every row's token, read back from the device once."""
        rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if not rows:
            return argmax_rows(logits)
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
        chosen = (probs / noise).argmax(dim=-1)
        if logits.device.type == "cpu":  # no device to wait for; numpy's argmax for the greedy rows
            tokens = argmax_rows(logits)
            for i, token in zip(rows, chosen.tolist(), strict=True):
                tokens[i] = token
            return tokens
        every = logits.argmax(dim=-1)
        every[torch.tensor(rows, device=every.device)] = chosen
        return every.tolist()


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's index of its largest value (the first one on ties, NaN counting as largest, as in
    torch). float32 rows on CPU go through numpy: torch's CPU argmax along a row is not vectorised
    (64 x 8192 float32: 1.06 ms against numpy's 0.14 ms on a 2-core AVX2 VM, the largest part of a
    greedy decode step's host time; a 128k vocabulary makes it 16x that)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.contiguous().numpy().argmax(axis=1).tolist()
    return logits.argmax(dim=-1).tolist()


def _bad_word_tokens(output: list[int], bad_words: list[list[int]]) -> list[int]:
    """Last tokens of the bad words whose other tokens the output just produced (vLLM's rule)."""
    banned = []
    for words in bad_words:
        prefix = words[:-1]
        if not prefix or output[len(output) - len(prefix) :] == prefix:
            banned.append(words[-1])
    return banned


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


def _batch_logprobs(
    raw: torch.Tensor, rows: list[int], tokens: list[int], tops: list[int]
) -> dict[int, tuple[float, dict[int, Logprob]]]:
    """``_logprobs`` for several rows at once: one read back from the device per quantity instead of
    three per row. Empty if it raises, so each row is then taken alone (and only a faulty one fails)."""
    try:
        sub = raw[torch.tensor(rows, device=raw.device)]
        chosen = sub.gather(1, torch.tensor([tokens[r] for r in rows], device=raw.device)[:, None])
        ranks = ((sub > chosen).sum(dim=1) + 1).tolist()
        values = chosen[:, 0].tolist()
        k = min(max(tops), sub.shape[1])
        top_values, top_ids = sub.topk(k, dim=1) if k else (sub[:, :0], sub[:, :0].long())
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
    except Exception:
        return {}
    result = {}
    for j, row in enumerate(rows):
        entry = {tokens[row]: Logprob(values[j], ranks[j])}
        for rank, (v, t) in enumerate(zip(top_values[j][: tops[j]], top_ids[j][: tops[j]], strict=True), 1):
            entry.setdefault(t, Logprob(v, rank))
        result[row] = (values[j], entry)
    return result


def _logprobs(raw: torch.Tensor, token: int, top: int) -> tuple[float, dict[int, Logprob]]:
    value = raw[token].item()
    rank = int((raw > raw[token]).sum().item()) + 1
    result = {token: Logprob(value, rank)}
    if top:
        values, ids = raw.topk(top)
        for r, (v, t) in enumerate(zip(values.tolist(), ids.tolist(), strict=True), start=1):
            result.setdefault(t, Logprob(v, r))
    return value, result
