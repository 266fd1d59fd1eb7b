"""OpenAI request models (pydantic) and the one validator that reports unknown request fields.

Every request model derives from ``OpenAIRequest``. Its validator is the single place that looks at
fields the model does not know: the removed legacy ``guided_*`` fields get one WARNING per distinct
set for the process lifetime (naming them and pointing to ``structured_outputs``/``response_format``;
the request is still served, without the constraint), anything else goes to DEBUG. Unknown fields are
allowed rather than rejected because OpenAI clients grow fields faster than servers do.
Response models live in ``response_models.py``.
"""

from __future__ import annotations

import logging
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


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema for the arguments object
    strict: bool | None = None


class ChatTool(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False  # return the sampled tokens' logprobs
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # alternatives (needs logprobs)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32)  # OpenAI's newer max_tokens
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # extend the last (assistant) message instead of a new turn
    chat_template: str | None = None  # needs --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto with tools
    parallel_tool_calls: bool = True  # False: at most one call per answer

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


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
