"""SamplingParams (vLLM names), the RequestOutputKind a request asks for, and the TokenConstraint hook
used by structured outputs."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

_GREEDY_EPS = 1e-5
MAX_TOP_K = 2**31 - 1  # top_k beyond the vocabulary keeps all tokens; past int32 it is an overflow
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on one token's logit bias
MAX_LOGPROBS = 20  # most top alternatives per token (logprobs, prompt_logprobs), as OpenAI and vLLM


class RequestOutputKind(enum.Enum):
    """Which outputs the engine hands back for a request (vLLM's names).

    CUMULATIVE: an output at every step that samples it, with the whole text and token ids so far.
    DELTA: an output at every step that samples it, with only the text, token ids and logprobs added
    since the request's last output (``cumulative_logprob`` stays the running sum; prompt logprobs come
    with the first output alone), so building one costs the same at the ten-thousandth token as at the
    first; the server's streams ask for it and put the deltas together themselves. FINAL_ONLY: one
    output, when the request finishes (or fails): no output is built on the steps before, and unless
    the request has stop strings, which are matched against the text as it grows, its text is
    detokenised only then, by the same incremental calls, so it is the text a CUMULATIVE request ends
    with, byte for byte (a failed request's too: the text up to its failure). The server asks for it
    for requests that do not stream, ``LLM.generate`` for all of its requests.

    While a request with stop strings runs (and drops them from its text: no
    ``include_stop_str_in_output``), the last ``longest stop - 1`` characters of its text are held back
    from its outputs, as vLLM holds them: a stop string that starts in one step's text and ends in the
    next is never half sent. Its last output has the text whole."""

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


@runtime_checkable
class TokenConstraint(Protocol):
    """Per-sequence state machine that restricts which tokens may come next (e.g. a JSON grammar)."""

    def fill_mask(self, logits: torch.Tensor) -> None:
        """Set the logits of disallowed tokens to -inf, in place (1-D float tensor [vocab])."""

    def accept(self, token_id: int) -> None:
        """Advance past the sampled token."""

    def is_terminated(self) -> bool:
        """True once the constraint is complete: the sequence then finishes with reason "stop"."""


@dataclass
class SamplingParams:
    n: int = 1  # completions per prompt
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus: smallest set of tokens whose probability sums to top_p
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 keeps all
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one
    seed: int | None = None  # per-request seed: same seed, same output
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence among generated tokens
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of prompt+output tokens
    stop: list[str] = field(default_factory=list)  # stop strings (not included in the text by default)
    stop_token_ids: list[int] = field(default_factory=list)  # extra token ids that end the sequence
    max_tokens: int | None = 16  # None: until max_model_len; 0: score the prompt only, generate nothing
    min_tokens: int = 0  # EOS and stop tokens are masked until this many tokens are generated
    ignore_eos: bool = False  # keep going past EOS (benchmarks, parity tests)
    logprobs: int | None = None  # return the sampled token's logprob plus this many top alternatives
    prompt_logprobs: int | None = None  # each prompt token's logprob plus this many top alternatives
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # when set, only these tokens may be sampled
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # token sequences never generated
    skip_special_tokens: bool = True  # drop special tokens from the text
    include_stop_str_in_output: bool = False  # keep the matched stop string in the text
    constraint_factory: Callable[[], TokenConstraint] | None = None  # one constraint per output sequence
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # which outputs the engine hands back

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        self.bad_words_token_ids = [list(words) for words in self.bad_words_token_ids or []]
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first bad field; with ``vocab_size``, token ids are checked too.
        A message is formatted only once its check fails: a request is validated several times on
        its way in (16 messages built on every call cost 8 us of the event loop's time)."""
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be -1, 0 (off) or in [1, {MAX_TOP_K}], got {self.top_k}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError(f"seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {self.seed}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if self.max_tokens is not None and not self.max_tokens >= 0:
            raise ValueError(f"max_tokens must be non-negative, got {self.max_tokens}")
        if not self.min_tokens >= 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and not self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        if not all(self.stop):
            raise ValueError("stop strings must be non-empty")
        if not all(abs(b) <= MAX_LOGIT_BIAS for b in self.logit_bias.values()):
            raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty")
        if not all(self.bad_words_token_ids):
            raise ValueError("bad_words must be non-empty token sequences")
        if vocab_size is None:
            return
        if not _in_vocab(self.stop_token_ids, vocab_size):
            raise ValueError(f"stop_token_ids must be in [0, {vocab_size})")
        if not _in_vocab(self.logit_bias, vocab_size):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab_size})")
        if not _in_vocab(self.allowed_token_ids or [], vocab_size):
            raise ValueError(f"allowed_token_ids must be in [0, {vocab_size})")
        if not all(_in_vocab(words, vocab_size) for words in self.bad_words_token_ids):
            raise ValueError(f"bad_words token ids must be in [0, {vocab_size})")

    def sequence_seed(self, index: int) -> int | None:
        """The seed of output sequence ``index``: distinct per sequence, always a valid torch seed."""
        return None if self.seed is None else (self.seed + index) % 2**64

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_masks(self) -> bool:
        """True when the sampler must edit this request's logits row before choosing."""
        return bool(
            self.needs_penalties or self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids
        )

    @property
    def needs_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


def _in_vocab(ids, vocab_size: int) -> bool:
    return all(isinstance(t, int) and 0 <= t < vocab_size for t in ids)
