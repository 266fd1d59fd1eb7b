"""POST /v1/chat/completions: render the chat with the engine's template (one BOS), generate, answer.

Streaming sends OpenAI chunks over SSE: a role chunk per choice, content deltas, tool-call deltas, a
finish chunk per choice, an optional usage chunk, then ``data: [DONE]``. The first output is awaited
before the 200 goes out, so a request the engine rejects still gets a proper 400. Tool calls are held
back until complete (content before them streams), then sent whole in one delta per call.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from keepwarm_runtime.engine.outputs import CompletionOutput, RequestOutput
from keepwarm_runtime.server.base.deltas import DeltaTracker
from keepwarm_runtime.server.base.errors import APIError, BadRequest
from keepwarm_runtime.server.base.logprobs import chat_logprobs, prompt_logprobs
from keepwarm_runtime.server.base.metrics import RequestTimer
from keepwarm_runtime.server.base.protocol import UsageInfo, random_id
from keepwarm_runtime.server.base.routes import Route
from keepwarm_runtime.server.base.serving import (
    ServingContext,
    race_disconnect,
    structured_params,
    truncate_prompt,
)
from keepwarm_runtime.server.base.sse import StreamHead, sse_done, sse_event
from keepwarm_runtime.server.openai.chat.audio import audio_chat_prompt, has_audio_parts
from keepwarm_runtime.server.openai.chat.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    FunctionCallOut,
    ToolCallDelta,
    ToolCallOut,
)
from keepwarm_runtime.server.openai.chat.tool_parsers import ParsedOutput
from keepwarm_runtime.server.openai.chat.tools import (
    ToolPlan,
    call_id,
    finish_reason,
    message_for_template,
    parse_output,
    plan_tools,
)

if TYPE_CHECKING:
    from keepwarm_runtime.engine.multimodal import AudioFeatures
    from keepwarm_runtime.engine.sampling_params import SamplingParams

_ROLES = {"developer": "system"}  # OpenAI's newer name; templates know "system"
# apply_chat_template arguments the server sets itself: a request may not override them.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


@dataclass
class PreparedChat:
    """A chat request made ready for the engine (shared with /v1/responses)."""

    prompt_ids: list[int]
    params: SamplingParams
    plan: ToolPlan
    top_n: int | None  # logprob alternatives per token, None: no logprobs
    audio: AudioFeatures | None = None  # audio features for the placeholder tokens, or None


async def prepare_chat(ctx: ServingContext, req: ChatCompletionRequest, raw: Request) -> PreparedChat:
    """Render, tokenize and turn ``req`` into SamplingParams; every refusal is a 400 naming its field.

    Audio content parts (server/openai/chat/audio.py) are decoded into the model's audio features; the
    engine's step encodes them into the embeddings that replace the prompt's placeholder tokens."""
    ctx.check_model(req.model)
    engine = ctx.engine
    plan = plan_tools(req, ctx.options.tool_call_parser)
    template_kwargs = _template_kwargs(ctx, req, plan)
    if req.top_logprobs and not req.logprobs:
        raise BadRequest("top_logprobs needs logprobs=true", param="top_logprobs")
    audio = None
    if has_audio_parts(req.messages):
        if req.truncate_prompt_tokens is not None:
            raise BadRequest(
                "truncate_prompt_tokens cannot cut through audio", param="truncate_prompt_tokens"
            )
        add_generation_prompt = template_kwargs.pop("add_generation_prompt")
        prompt_ids, audio = await audio_chat_prompt(
            engine,
            ctx.model_dir,
            req.messages,
            settings=getattr(raw.app.state, "audio_settings", None),
            metrics=getattr(raw.app.state, "audio_metrics", None),
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=template_kwargs,
        )
    else:
        messages = _messages(req)
        prompt_ids = truncate_prompt(
            await ctx.preprocess(_render, engine.tokenizer, messages, template_kwargs),
            req.truncate_prompt_tokens,
        )
    max_tokens = ctx.check_length(len(prompt_ids), req.token_limit())
    if req.prompt_logprobs is not None:
        ctx.check_prompt_logprobs(len(prompt_ids), "prompt_logprobs")
    top_n = (req.top_logprobs or 0) if req.logprobs else None
    structured = None
    if plan.forced:
        # A forced call is this turn's whole output, so it governs; response_format/structured_outputs
        # govern text output, of which a forced turn has none (OpenAI accepts the pair, and clients
        # such as instructor and openai-agents send it). They are still checked, and apply to any
        # later turn that answers in text.
        structured_params(req)
        from keepwarm_runtime.engine.structured import StructuredOutputsParams

        structured = StructuredOutputsParams(json=plan.schema)
    params = await ctx.sampling_params(req, max_tokens, top_n, structured, structured_param="tools")
    return PreparedChat(prompt_ids, params, plan, top_n, audio)


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, raw: Request) -> Any:
    arrival = time.perf_counter()  # TTFT includes rendering and grammar compilation
    prepared = await prepare_chat(ctx, req, raw)
    prompt_ids, plan, top_n = prepared.prompt_ids, prepared.plan, prepared.top_n
    request_id = random_id("chatcmpl")
    timer = RequestTimer(ctx.metrics, len(prompt_ids), arrival=arrival)
    lora = ctx.lora_name(req.model)
    outputs = ctx.stream(
        request_id, prompt_ids, prepared.params, timer, req.priority, prepared.audio, lora, req.stream
    )
    if req.stream:
        first = await race_disconnect(anext(outputs), raw)
        body = _stream(req, plan, request_id, ctx.response_model(req.model), len(prompt_ids), first, outputs)
        return StreamingResponse(body, media_type="text/event-stream")
    final = await race_disconnect(last_output(outputs), raw)
    choices = [_choice(req, plan, o, top_n) for o in final.outputs]
    usage = _usage(len(prompt_ids), final.outputs)
    scored = None
    if req.prompt_logprobs is not None and final.prompt_logprobs is not None:
        scored = prompt_logprobs(final.prompt_logprobs, req.return_tokens_as_token_ids)
    response = ChatCompletionResponse(
        id=request_id,
        model=ctx.response_model(req.model),
        choices=choices,
        usage=usage,
        prompt_logprobs=scored,
    )
    return JSONResponse(response.model_dump(exclude_none=False))


def _messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    try:
        messages = [message_for_template(m, _ROLES.get(m.role, m.role), m.text()) for m in req.messages]
    except ValueError as exc:
        raise BadRequest(str(exc), param="messages") from exc
    if req.continue_final_message and messages[-1]["role"] != "assistant":
        raise BadRequest(
            "continue_final_message needs the last message to be the assistant's", param="messages"
        )
    return messages


def _template_kwargs(ctx: ServingContext, req: ChatCompletionRequest, plan: ToolPlan) -> dict[str, Any]:
    """apply_chat_template's keyword arguments; 400 for what a request may not set."""
    extra = dict(req.chat_template_kwargs or {})
    template = req.chat_template
    if "chat_template" in extra:
        template = extra.pop("chat_template")
    if template is not None and not ctx.options.trust_request_chat_template:
        raise BadRequest(
            "request-supplied chat templates are refused (the server runs the template): start the server "
            "with --trust-request-chat-template to allow them",
            param="chat_template",
        )
    if template is not None and not isinstance(template, str):
        raise BadRequest("chat_template must be a string", param="chat_template")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & extra.keys())
    if reserved:
        raise BadRequest(
            f"chat_template_kwargs may not set {', '.join(reserved)} (the server sets it)",
            param=f"chat_template_kwargs.{reserved[0]}",
        )
    if req.continue_final_message and req.add_generation_prompt:
        raise BadRequest(
            "continue_final_message and add_generation_prompt cannot both be true (set add_generation_prompt "
            "false to continue the last message)",
            param="continue_final_message",
        )
    kwargs = extra | {
        "add_generation_prompt": req.add_generation_prompt,
        "continue_final_message": req.continue_final_message,
    }
    if template is not None:
        kwargs["chat_template"] = template
    if plan.template_tools is not None:
        kwargs["tools"] = plan.template_tools
    return kwargs


def _render(tokenizer: Any, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> list[int]:
    from keepwarm_runtime.engine.chat import render_chat

    add_generation_prompt = kwargs.pop("add_generation_prompt")
    try:
        return render_chat(
            tokenizer, messages, add_generation_prompt=add_generation_prompt, chat_template_kwargs=kwargs
        )
    except Exception as exc:  # the template raised (jinja errors, bad roles)
        raise BadRequest(f"cannot apply the chat template: {exc}", param="messages") from exc


async def last_output(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    final = None
    async for final in outputs:  # noqa: B007 - keep the last
        pass
    if final is None:
        raise APIError("the engine ended the request without an output")
    return final


def _usage(prompt_tokens: int, outputs: list[CompletionOutput]) -> UsageInfo:
    completion = sum(len(o.token_ids) for o in outputs)
    return UsageInfo(
        prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion
    )


def _tool_calls(parsed: ParsedOutput) -> list[ToolCallOut]:
    return [
        ToolCallOut(id=call_id(), function=FunctionCallOut(name=c.name, arguments=c.arguments))
        for c in parsed.tool_calls
    ]


def _choice(req: ChatCompletionRequest, plan: ToolPlan, o: CompletionOutput, top_n: int | None) -> ChatChoice:
    parsed = parse_output(plan, o.text)
    logprobs = None
    if top_n is not None:
        logprobs = chat_logprobs(o.token_ids, o.logprobs or [], top_n, req.return_tokens_as_token_ids)
    return ChatChoice(
        index=o.index,
        message=ChatResponseMessage(content=parsed.content, tool_calls=_tool_calls(parsed)),
        logprobs=logprobs,
        finish_reason=finish_reason(plan, parsed, o.finish_reason),
        stop_reason=o.stop_reason,
    )


def held_back(plan: ToolPlan, text: str, sent: int = 0) -> int:
    """Characters at the end of ``text`` a stream must hold back under ``plan``, having sent ``sent``."""
    if plan.forced:
        return len(text)
    if plan.parser is not None:
        return len(text) - plan.parser.safe_content_length(text, sent)
    return 0


async def _stream(
    req: ChatCompletionRequest,
    plan: ToolPlan,
    request_id: str,
    model: str,
    prompt_tokens: int,
    first: RequestOutput,
    outputs: AsyncIterator[RequestOutput],
) -> AsyncIterator[str]:
    created = int(time.time())
    top_n = (req.top_logprobs or 0) if req.logprobs else None
    continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
    # One choice, no logprobs, no usage a chunk: a chunk that only adds text is written from the head.
    plain = req.n == 1 and top_n is None and not continuous
    head = StreamHead(request_id, "chat.completion.chunk", created, model)
    tracker = DeltaTracker()

    def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
        body = ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices, usage=usage)
        return sse_event(body.model_dump(exclude_none=True))

    last = first
    try:
        yield chunk(
            [
                ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                for i in range(req.n)
            ]
        )
        output: RequestOutput | None = first
        while output is not None:
            choices = []
            for o in output.outputs:
                d = tracker.delta(o.index, o, hold_back=held_back(plan, o.text, tracker.sent(o.index)))
                if d is None:
                    continue
                if plain and d.finish_reason is None:  # most chunks: the choice's new text alone
                    yield head.content(o.index, d.text)
                    continue
                logprobs = None
                if top_n is not None and d.logprobs is not None:
                    logprobs = chat_logprobs(d.token_ids, d.logprobs, top_n, req.return_tokens_as_token_ids)
                delta, reason = DeltaMessage(content=d.text), d.finish_reason
                if d.finish_reason is not None and plan.mode != "none":
                    delta, reason = _final_delta(plan, o, d.text)
                choices.append(
                    ChatStreamChoice(
                        index=o.index,
                        delta=delta,
                        logprobs=logprobs,
                        finish_reason=reason,
                        stop_reason=d.stop_reason,
                    )
                )
            if choices:
                yield chunk(choices, _usage(prompt_tokens, output.outputs) if continuous else None)
            last = output
            output = await anext(outputs, None)
        if req.stream_options and req.stream_options.include_usage:
            yield chunk([], _usage(prompt_tokens, last.outputs))
    except APIError as exc:
        yield sse_event(exc.body())
    finally:
        await outputs.aclose()  # a client that went away aborts its sequence here
    yield sse_done()


def _final_delta(plan: ToolPlan, o: CompletionOutput, unsent: str) -> tuple[DeltaMessage, str | None]:
    """The last delta of a choice under a tool plan: remaining content, then every call whole."""
    parsed = parse_output(plan, o.text)
    if not parsed.tool_calls:
        return DeltaMessage(content=unsent), o.finish_reason
    sent = o.text[: len(o.text) - len(unsent)].strip()
    content = parsed.content or ""
    rest = content[len(sent) :] if content.startswith(sent) else ""
    calls = [
        ToolCallDelta(index=i, id=call.id, type="function", function=call.function)
        for i, call in enumerate(_tool_calls(parsed))
    ]
    return DeltaMessage(content=rest or None, tool_calls=calls), finish_reason(plan, parsed, o.finish_reason)


ROUTES = (
    Route("/v1/chat/completions", "POST", create_chat_completion, body=ChatCompletionRequest, inference=True),
)
