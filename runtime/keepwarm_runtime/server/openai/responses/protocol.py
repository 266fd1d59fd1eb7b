"""The OpenAI Responses API shapes (/v1/responses): the request, its input items, the response.

Only what this server honours is modelled; fields it cannot honour (stored responses, background
runs, reasoning options, ``include``) are refused by name in ``serving.py``.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field

from keepwarm_runtime.engine.sampling_params import SEED_RANGE
from keepwarm_runtime.server.base.protocol import INT32, OpenAIBaseModel, OpenAIRequest, random_id


class InputMessage(OpenAIBaseModel):
    """A message item; content is text or a list of ``input_text``/``output_text`` parts."""

    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        pieces = []
        for part in self.content:
            if part.get("type") not in ("input_text", "output_text", "text"):
                raise ValueError(f"content part type {part.get('type')!r} is not supported; send input_text")
            pieces.append(str(part.get("text", "")))
        return "".join(pieces)


class FunctionCallItem(OpenAIBaseModel):
    """An earlier function call of the model, sent back as input."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = "{}"
    id: str | None = None


class FunctionCallOutputItem(OpenAIBaseModel):
    """The result of a function call, as input."""

    type: Literal["function_call_output"]
    call_id: str
    output: str


InputItem = InputMessage | FunctionCallItem | FunctionCallOutputItem


class FunctionTool(OpenAIBaseModel):
    type: Literal["function"] = "function"
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    name: str


class TextFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextOptions(OpenAIBaseModel):
    format: TextFormat = Field(default_factory=TextFormat)


class ResponsesRequest(OpenAIRequest):
    model: str | None = None
    input: str | list[InputItem] = Field(min_length=1)
    instructions: str | None = None  # a system message before the input
    max_output_tokens: int | None = Field(default=None, ge=1, le=INT32)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stream: bool = False
    tools: list[FunctionTool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextOptions | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)  # echoed back
    user: str | None = Field(default=None, max_length=256)
    # Refused unless at their no-op values (see serving.py):
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str = Field(default_factory=lambda: random_id("msg"))
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str = Field(default_factory=lambda: random_id("fc"))
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed"] = "completed"


class ResponseUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: dict[str, int] = Field(
        default_factory=lambda: {"cached_tokens": 0, "cache_write_tokens": 0}
    )
    output_tokens_details: dict[str, int] = Field(default_factory=lambda: {"reasoning_tokens": 0})


class ResponseObject(BaseModel):
    id: str = Field(default_factory=lambda: random_id("resp"))
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete", "failed"] = "completed"
    incomplete_details: dict[str, str] | None = None  # {"reason": "max_output_tokens"}
    error: dict[str, Any] | None = None  # {"code", "message"} when status is "failed"
    model: str
    output: list[OutputMessage | OutputFunctionCall] = Field(default_factory=list)
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    metadata: dict[str, str] = Field(default_factory=dict)
    usage: ResponseUsage | None = None
