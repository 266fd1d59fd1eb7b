"""POST /v1/completions shapes: the legacy completions request and its response.

The sampling fields it shares with chat (``SamplingRequest``) and the logprob shapes are in
``server/base/protocol.py``.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field

from keepwarm_runtime.engine.sampling_params import MAX_LOGPROBS
from keepwarm_runtime.server.base.protocol import (
    INT32,
    CompletionLogprobs,
    PromptLogprobs,
    SamplingRequest,
    UsageInfo,
    random_id,
)


class CompletionRequest(SamplingRequest):
    # A string, a list of strings (one choice set each), token ids, or a list of token-id lists.
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0, le=INT32)  # 0 with echo: score the prompt only
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # top alternatives per token
    echo: bool = False  # prepend the prompt to the text (and, with logprobs, its tokens' logprobs)
    suffix: str | None = None  # not supported (400)

    def token_limit(self) -> int | None:
        # The legacy completions API defaults to 16 tokens.
        return 16 if self.max_tokens is None else self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts (text or token ids)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return list(prompt)


# --- responses -------------------------------------------------------------------------------------


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | None while streaming
    stop_reason: str | int | None = None  # the stop string or token id that ended it (vLLM extra)
    prompt_logprobs: PromptLogprobs | None = None  # vLLM extra, when the request asks


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
