"""Sequence: one output stream of a request (a request with n=3 has three), and its lifecycle.

Field ownership (so no two classes fight over the same state): the scheduler owns status,
num_computed_tokens, block_ids and block_hashes; the engine's postprocessing owns token_ids and the
output fields (finish/stop reason, logprobs, prompt logprobs, text), and the engine's step loop
num_pending (tokens sampled by a step still running: engine/overlap.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from keepwarm_runtime.engine.multimodal import MultimodalInput
from keepwarm_runtime.engine.outputs import Logprob
from keepwarm_runtime.engine.sampling_params import SamplingParams, TokenConstraint

TEXT_PIECES = 64  # a sequence's newest text pieces joined into one when there are more


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)  # slots: its fields are read for every sequence of every step
class Sequence:
    request_id: str
    index: int  # completion index within the request
    prompt_token_ids: list[int]
    params: SamplingParams
    token_ids: list[int] = field(init=False)  # prompt + generated tokens
    priority: int = 0  # lower values are admitted first; FCFS among equals
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens that came from the prefix cache at admission
    block_ids: list[int] = field(default_factory=list)  # KV blocks, in token order
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of the full blocks so far
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    # One entry per prompt token (the first None: nothing precedes it), filled chunk by chunk during
    # prefill (engine/prompt_logprobs.py); only on completion 0 of a request that asks for them.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    cumulative_logprob: float = 0.0
    # The detokenised output (stop string already cut) in pieces, as steps add them, and its length:
    # ``text`` joins them. A string attribute grown by += is copied whole at every token (CPython
    # extends a string in place only when nothing else refers to it), which at tens of thousands of
    # tokens of output costs some 10 us a token; pieces are joined when a reader needs the whole, and
    # the newest (``text_loose`` of them, added since the last join) into one whenever there are more
    # than TEXT_PIECES, so each character is copied once by appends and the newest text is read alone.
    text_pieces: list[str] = field(default_factory=list)
    text_len: int = 0
    text_loose: int = 0
    constraint: TokenConstraint | None = None
    generator: torch.Generator | None = None  # per-sequence RNG when the request has a seed
    # Multimodal (engine/multimodal.py): embeddings for placeholder tokens, set by the engine's step when
    # it encodes the request's audio (before the sequence can be scheduled); their digest salts block hashes.
    multimodal: MultimodalInput | None = None
    # LoRA (engine/lora): the adapter this sequence runs with (None: the base) and the identity of its
    # registration, which salts block hashes so KV computed under one adapter never serves another.
    lora_name: str | None = None
    lora_id: int = 0
    # Greedy, nothing to edit in its logits row (no penalties, biases, masks or min_tokens) and no
    # logprobs: the sampler's argmax alone serves it (Sampler.greedy_tokens). Read from the params
    # once, here: the engine never changes a request's params after add_request.
    plain_greedy: bool = field(init=False, default=False)
    # Nothing the sampler does for it reads its tokens (no penalties, bad words, min_tokens or
    # constraint) and it samples at least one: its next step may run, and be sampled, before its last
    # token is known (engine/overlap.py).
    samples_ahead: bool = field(init=False, default=False)
    # Tokens sampled for it by a step still running (0 or 1 when a step is scheduled): they count
    # towards its length for the scheduler, and the step that reads one takes it from that step's output.
    num_pending: int = 0
    # How much of its output its request's outputs have shown: the text's characters (any kind: a
    # stop string's hold-back never takes back what was shown) and the tokens (DELTA outputs).
    num_sent_tokens: int = 0
    num_sent_chars: int = 0

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        p = self.params
        self.plain_greedy = p.greedy and not p.needs_masks and p.logprobs is None and not p.min_tokens
        self.samples_ahead = not (
            p.needs_penalties
            or p.bad_words_token_ids
            or p.min_tokens
            or p.constraint_factory is not None
            or p.max_tokens == 0
        )
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.index == 0:
            self.prompt_logprobs = [None]

    @property
    def text(self) -> str:
        """The whole text (its pieces joined into one, kept as the only piece)."""
        self._join_last(len(self.text_pieces))
        return self.text_pieces[0] if self.text_pieces else ""

    def add_text(self, text: str) -> None:
        self.text_pieces.append(text)
        self.text_len += len(text)
        self.text_loose += 1
        if self.text_loose > TEXT_PIECES:
            self._join_last(self.text_loose)

    def _join_last(self, count: int) -> None:
        """The last ``count`` pieces as one."""
        if count > 1:
            self.text_pieces[-count:] = ["".join(self.text_pieces[-count:])]
        self.text_loose = 0

    def text_slice(self, start: int, end: int) -> str:
        """``text[start:end]`` for ``0 <= start <= end <= text_len``, joining only the pieces from the
        one holding ``start`` on (a stream's new text: the last piece or few)."""
        if start >= end:
            return ""
        pieces, i, offset = self.text_pieces, len(self.text_pieces), self.text_len
        while offset > start:
            i -= 1
            offset -= len(pieces[i])
        tail = pieces[i] if i == len(pieces) - 1 else "".join(pieces[i:])
        return tail[start - offset : end - offset]

    def cut_text(self, end: int) -> None:
        """Keep the first ``end`` characters (a stop string found)."""
        self.text_pieces[:] = [self.text[:end]]
        self.text_len, self.text_loose = end, 0

    @property
    def hash_salt(self) -> int | None:
        """Starts the prefix-cache hash chain: the media digest and the adapter, so KV computed for
        other audio or under another adapter is never shared."""
        digest = self.multimodal.digest if self.multimodal is not None else None
        return digest if self.lora_name is None else hash((digest, "lora", self.lora_id))

    @property
    def needs_prompt_logits(self) -> bool:
        """True while prompt positions whose logprobs were asked are still to be scored: such a
        sequence computes its prompt itself (no prefix-cache hits, which would skip positions)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    def ends_when_pending_lands(self) -> bool:
        """Its pending tokens bring it to max_tokens: it finishes when they land (engine/overlap.py)."""
        limit = self.params.max_tokens
        return limit is not None and self.num_output_tokens + self.num_pending >= limit

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
