"""Per-choice stream bookkeeping shared by chat and completions: what is new since the last chunk.

The engine hands back cumulative outputs; a stream must send each choice's new text, new tokens (and
their logprobs) once, its finish once, and nothing after that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from keepwarm_runtime.engine.outputs import CompletionOutput, Logprob


@dataclass
class ChoiceDelta:
    text: str  # text not sent yet
    token_ids: list[int]  # tokens not sent yet
    logprobs: list[dict[int, Logprob]] | None  # their logprobs, when requested
    first: bool  # nothing was sent for this choice before
    finish_reason: str | None
    stop_reason: str | int | None
    total_tokens: int  # tokens generated so far for this choice


class DeltaTracker:
    """Tracks, per choice key, how much of the cumulative output has been sent."""

    def __init__(self) -> None:
        self._chars: dict[Any, int] = {}
        self._tokens: dict[Any, int] = {}
        self._done: set[Any] = set()

    def delta(self, key: Any, output: CompletionOutput, hold_back: int = 0) -> ChoiceDelta | None:
        """What is new for choice ``key``; None if nothing is. ``hold_back`` keeps the last characters
        of an unfinished output unsent (a tool call may be starting there)."""
        if key in self._done:
            return None
        first = key not in self._chars
        sent_chars, sent_tokens = self._chars.get(key, 0), self._tokens.get(key, 0)
        finished = output.finish_reason is not None
        end = len(output.text) if finished else max(sent_chars, len(output.text) - hold_back)
        text, new_ids = output.text[sent_chars:end], output.token_ids[sent_tokens:]
        if not first and not text and not new_ids and not finished:
            return None
        self._chars[key], self._tokens[key] = end, len(output.token_ids)
        if finished:
            self._done.add(key)
        logprobs = output.logprobs[sent_tokens:] if output.logprobs is not None else None
        return ChoiceDelta(
            text, new_ids, logprobs, first, output.finish_reason, output.stop_reason, len(output.token_ids)
        )
