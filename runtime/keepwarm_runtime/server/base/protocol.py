"""The OpenAI shapes route groups share, and the one validator that reports unknown request fields.

Every request model derives from ``OpenAIRequest``. Its validator is the single place that looks at
fields the model does not know: the removed legacy ``guided_*`` fields get one WARNING per distinct
set for the process lifetime (naming them and pointing to ``structured_outputs``/``response_format``;
the request is still served, without the constraint), anything else goes to DEBUG. Unknown fields are
allowed rather than rejected because OpenAI clients grow fields faster than servers do.

Shared here: ``SamplingRequest`` (the fields of chat and completions), ``ChatMessage`` (chat and
/tokenize), ids, usage, the error body, and the logprob shapes ``logprobs.py`` builds. A route group's
own request and response models live in its ``protocol.py`` (server/openai/<group>/protocol.py).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from keepwarm_runtime.engine.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_TOP_K, SEED_RANGE
from keepwarm_runtime.log_once import warning_once

logger = logging.getLogger(__name__)

MAX_STOP_STRINGS = 64  # stop strings per request
MAX_STOP_CHARS = 1024  # characters per stop string
MAX_TOKEN_LIST = 1 << 20  # ids in stop_token_ids / allowed_token_ids / logit_bias
INT32 = 2**31 - 1  # bound for counts and priorities: past it a value is a mistake or an attack

# Fields vLLM accepted before `structured_outputs` replaced them; we keep reporting them, not honouring.
REMOVED_FIELDS: frozenset[str] = frozenset(
    {
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "guided_decoding_backend",
        "guided_whitespace_pattern",
    }
)


class OpenAIBaseModel(BaseModel):
    """Nested objects: unknown fields are kept (clients send vendor extras), never an error."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)


class OpenAIRequest(OpenAIBaseModel):
    """Base of every request body; owns the unknown-field report."""

    @model_validator(mode="before")
    @classmethod
    def _report_unknown_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
        unknown = [key for key in data if key not in known]
        removed = tuple(sorted(key for key in unknown if key in REMOVED_FIELDS))
        if removed:
            warning_once(
                logger,
                ("removed-fields", removed),
                "request fields %s were removed and are ignored; use `structured_outputs` "
                '(e.g. {"structured_outputs": {"json": <schema>}}, also regex, choice, grammar) '
                "or `response_format` instead",
                ", ".join(removed),
            )
        others = [key for key in unknown if key not in REMOVED_FIELDS]
        if others:
            logger.debug("ignoring unknown request fields %s in %s", ", ".join(others), cls.__name__)
        return data


class StructuredOutputsOptions(OpenAIBaseModel):
    """`structured_outputs` in a request: set exactly one of json, regex, choice, grammar, json_object."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")  # JSON schema
    regex: str | None = None  # the whole output matches this regex
    choice: list[str] | None = None  # the output is one of these strings
    grammar: str | None = None  # EBNF (rule `root`) or Lark grammar
    json_object: bool | None = None  # any JSON object
    any_whitespace: bool = False  # allow free whitespace between JSON tokens (default: compact)


class JsonSchemaSpec(OpenAIBaseModel):
    """`response_format.json_schema`."""

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    """`response_format`: text (no constraint), json_object, or json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False  # send a last chunk with usage and no choices
    continuous_usage_stats: bool = False  # put usage in every chunk


class SamplingRequest(OpenAIRequest):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI names, plus vLLM extras).

    Every bound that the engine would otherwise trip over (an int64 overflow, a huge list) is checked
    here, so nothing invalid reaches the engine thread.
    """

    model: str | None = None  # served model name; None means the only one
    max_tokens: int | None = Field(default=None, ge=1, le=INT32)  # None: up to the context length
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)  # None: 1.0
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=16)  # choices per prompt
    best_of: int | None = Field(default=None, ge=1, le=16)  # only best_of == n (all candidates returned)
    stop: str | list[str] | None = None  # stop strings (not included in the output)
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])  # same seed, same output
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    user: str | None = Field(default=None, max_length=256)  # OpenAI's end-user id: accepted, not used
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsOptions | None = None
    # vLLM extras
    top_k: int | None = Field(default=None, ge=-1, le=MAX_TOP_K)  # 0 or -1: disabled
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)
    min_tokens: int | None = Field(default=None, ge=0, le=INT32)
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_TOKEN_LIST)
    allowed_token_ids: list[int] | None = Field(default=None, min_length=1, max_length=MAX_TOKEN_LIST)
    bad_words: list[str] | None = Field(default=None, max_length=MAX_STOP_STRINGS)  # never generated
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    # each prompt token's logprob plus this many alternatives (vLLM's shape); not with stream
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    truncate_prompt_tokens: int | None = Field(default=None, ge=1, le=INT32)  # keep the last k tokens
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:<id>"
    priority: int = Field(default=0, ge=-INT32, le=INT32)  # lower is scheduled first

    @field_validator("stop")
    @classmethod
    def _bounded_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters")
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if bias is None:
            return bias
        if len(bias) > MAX_TOKEN_LIST:
            raise ValueError(f"at most {MAX_TOKEN_LIST} entries")
        for key, value in bias.items():
            if not key.strip().lstrip("-").isdigit():
                raise ValueError(f"keys are token ids, got {key[:40]!r}")
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise ValueError(f"values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        return bias

    @field_validator("bad_words")
    @classmethod
    def _bounded_words(cls, words: list[str] | None) -> list[str] | None:
        if words is not None and any(not w or len(w) > MAX_STOP_CHARS for w in words):
            raise ValueError(f"non-empty strings of at most {MAX_STOP_CHARS} characters")
        return words

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def token_bias(self) -> dict[int, float]:
        return {int(key): value for key, value in (self.logit_bias or {}).items()}


class TextContentPart(OpenAIBaseModel):
    type: Literal["text"] = "text"
    text: str


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str | dict[str, Any] = "{}"  # JSON text (OpenAI) or an object


class ToolCall(OpenAIBaseModel):
    """An earlier assistant turn's tool call, sent back in the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIBaseModel):
    """One message; content is text or a list of content parts (only text parts are supported)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: which call this answers

    def text(self) -> str:
        """The content as one string; raises ValueError for non-text parts."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        pieces = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"content part type {part.get('type')!r} is not supported; send text parts")
            pieces.append(TextContentPart.model_validate(part).text)
        return "".join(pieces)


# --- responses: ids, usage, errors, logprobs -------------------------------------------------------


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ErrorInfo(BaseModel):
    message: str  # what went wrong and what to change
    type: str  # "invalid_request_error", "service_unavailable_error", "server_error"
    param: str | None = None  # the offending request field, when one is
    code: str | None = None  # machine-readable: "model_not_found", "context_length_exceeded", ...


class ErrorResponse(BaseModel):
    error: ErrorInfo


class PromptLogprob(BaseModel):
    """One token of ``prompt_logprobs`` (vLLM's shape): keyed by the token id, as a string, in JSON."""

    logprob: float
    rank: int  # 1 = the model's most likely token at that position
    decoded_token: str | None = None


PromptLogprobs = list[dict[str, PromptLogprob] | None]  # one per prompt token; the first is None


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: parallel lists, one entry per token (with ``echo``, the prompt's first:
    its first token has no logprob and no alternatives)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None
