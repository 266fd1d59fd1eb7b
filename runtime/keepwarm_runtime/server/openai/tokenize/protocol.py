"""POST /tokenize and /detokenize shapes (vLLM's): the requests and their responses."""

from __future__ import annotations

from pydantic import BaseModel, Field

from keepwarm_runtime.server.base.protocol import MAX_TOKEN_LIST, ChatMessage, OpenAIRequest


class TokenizeRequest(OpenAIRequest):
    """POST /tokenize: a text ``prompt``, or chat ``messages`` rendered with the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # prompt only: add BOS like /v1/completions does
    add_generation_prompt: bool = True  # messages only


class DetokenizeRequest(OpenAIRequest):
    model: str | None = None
    tokens: list[int] = Field(max_length=MAX_TOKEN_LIST)


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str
