"""The llguidance fallback for JSON schemas xgrammar would enforce only loosely.

xgrammar stays the first backend (vLLM's ``auto`` order). When a schema uses a keyword xgrammar
ignores (see ``structured.unenforceable_keyword``), llguidance is asked instead: it implements some of
those exactly (``allOf``, ``format`` together with length bounds) and refuses the ones it cannot
(``uniqueItems``, ``not``, ``if``/``then``, ``oneOf``, unknown formats) with an error, so a schema is
either enforced by one backend or refused by name, never served loosely.

llguidance fills the same packed int32 token bitmask as xgrammar, so the mask is applied with
xgrammar's ``apply_token_bitmask_inplace`` (CPU and GPU), like every other constraint.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

try:  # optional extra: keepwarm-runtime[structured]
    import llguidance
    import llguidance.hf
except ImportError:  # pragma: no cover - exercised only without the extra
    llguidance = None


class LLGuidanceConstraint:
    """A ``TokenConstraint`` over one llguidance matcher."""

    def __init__(self, tokenizer: Any, grammar: str, vocab_size: int) -> None:
        import xgrammar as xgr

        self._apply = xgr.apply_token_bitmask_inplace
        self._matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        self._bitmask = torch.full((1, (vocab_size + 31) // 32), -1, dtype=torch.int32)
        self._vocab_size = vocab_size

    def fill_mask(self, logits_row: torch.Tensor) -> None:
        row = self._bitmask[0]
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        if self._matcher.is_error():
            raise RuntimeError(f"llguidance: {self._matcher.get_error()}")
        bitmask = self._bitmask.to(logits_row.device, non_blocking=True)
        self._apply(logits_row.view(1, -1), bitmask, vocab_size=self._vocab_size)

    def accept(self, token_id: int) -> bool:
        return self._matcher.consume_token(int(token_id))

    def is_terminated(self) -> bool:
        return self._matcher.is_stopped()


class LLGuidanceBackend:
    """Compiles JSON schemas for one tokenizer with llguidance; None from ``create`` without the extra."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=stop_token_ids or None
        )
        self._vocab_size = vocab_size

    @classmethod
    def create(cls, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> LLGuidanceBackend | None:
        return None if llguidance is None else cls(tokenizer, vocab_size, stop_token_ids)

    def json_factory(
        self, schema: dict[str, Any], any_whitespace: bool
    ) -> Callable[[], LLGuidanceConstraint]:
        """A factory of constraints for ``schema``; ValueError with llguidance's reason if it cannot."""
        options = {"whitespace_flexible": any_whitespace}
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=options)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer)
        if is_error:
            raise ValueError(str(messages[0] if messages else "rejected").splitlines()[0][:300])
        tokenizer, vocab_size = self._tokenizer, self._vocab_size
        return lambda: LLGuidanceConstraint(tokenizer, grammar, vocab_size)
