"""POST /v1/responses: the Responses API over the chat pipeline (text, tools, structured text).

The request becomes a chat request (instructions -> system message, input items -> messages,
function_call / function_call_output items -> assistant tool calls / tool messages), so templates,
tool plans, constraints and sampling are the chat route's. Nothing is stored: ``store``,
``previous_response_id``, ``background``, ``include`` and ``reasoning`` are refused by name unless
left at their no-op values. Streaming sends the named Responses events: created, in_progress, each
output item's added/done around its content (text deltas, function-call arguments), and one terminal
event by the response's status: ``response.completed``, ``response.incomplete`` (cut off at
``max_output_tokens``) or ``response.failed`` (the engine failed the request mid-stream). No reasoning
items are produced (``reasoning`` is refused), so none are streamed.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from keepwarm_runtime.engine.outputs import CompletionOutput, RequestOutput
from keepwarm_runtime.server.base.deltas import DeltaTracker
from keepwarm_runtime.server.base.errors import APIError, BadRequest, from_validation_error
from keepwarm_runtime.server.base.metrics import RequestTimer
from keepwarm_runtime.server.base.protocol import random_id
from keepwarm_runtime.server.base.routes import Route
from keepwarm_runtime.server.base.serving import ServingContext, race_disconnect
from keepwarm_runtime.server.base.sse import sse_event
from keepwarm_runtime.server.openai.chat.protocol import ChatCompletionRequest
from keepwarm_runtime.server.openai.chat.serving import held_back, last_output, prepare_chat
from keepwarm_runtime.server.openai.chat.tools import ToolPlan, call_id, parse_output
from keepwarm_runtime.server.openai.responses.protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    OutputFunctionCall,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)


def refuse_unsupported(req: ResponsesRequest) -> None:
    refusals = {
        "store": req.store is True,
        "previous_response_id": req.previous_response_id is not None,
        "background": req.background is True,
        "include": bool(req.include),
        "reasoning": bool(req.reasoning),
        "truncation": req.truncation == "auto",
    }
    for name, refused in refusals.items():
        if refused:
            raise BadRequest(
                f"{name} is not supported: this server keeps no responses and runs no reasoning options; "
                "send the whole conversation as input",
                param=name,
            )


def to_chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The equivalent chat request; a 400 (naming the Responses field) if it cannot be built."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    items = (
        [{"type": "message", "role": "user", "content": req.input}]
        if isinstance(req.input, str)
        else req.input
    )
    for item in items:
        if isinstance(item, dict):
            messages.append({"role": item["role"], "content": item["content"]})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        else:
            try:
                messages.append({"role": item.role, "content": item.text()})
            except ValueError as exc:
                raise BadRequest(str(exc), param="input") from exc
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "n": 1,
        "parallel_tool_calls": req.parallel_tool_calls,
    }
    for name in ("temperature", "top_p", "seed"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    if req.tools:
        body["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
            for t in req.tools
        ]
    choice = req.tool_choice
    if choice is not None:
        body["tool_choice"] = (
            choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice.name}}
        )
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type != "text":
        body["response_format"] = (
            {"type": "json_object"}
            if fmt.type == "json_object"
            else {
                "type": "json_schema",
                "json_schema": {"name": fmt.name or "response", "schema": fmt.schema_},
            }
        )
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from exc


def output_items(plan: ToolPlan, o: CompletionOutput) -> list[OutputMessage | OutputFunctionCall]:
    parsed = parse_output(plan, o.text)
    items: list[OutputMessage | OutputFunctionCall] = []
    if parsed.content or not parsed.tool_calls:
        items.append(OutputMessage(content=[OutputText(text=parsed.content or "")], status=_status(o)))
    items += [
        OutputFunctionCall(call_id=call_id(), name=c.name, arguments=c.arguments) for c in parsed.tool_calls
    ]
    return items


def _status(o: CompletionOutput) -> str:
    return "incomplete" if o.finish_reason == "length" else "completed"


def _response(req: ResponsesRequest, response_id: str, created: int) -> ResponseObject:
    return ResponseObject(
        id=response_id,
        created_at=created,
        model=req.model or "",
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        tools=[t.model_dump(exclude_none=True) for t in req.tools or []],
        tool_choice=req.tool_choice if req.tool_choice is not None else "auto",
        parallel_tool_calls=req.parallel_tool_calls,
        text=(
            req.text.model_dump(by_alias=True, exclude_none=True)
            if req.text
            else {"format": {"type": "text"}}
        ),
        metadata=req.metadata or {},
    )


def _finish(response: ResponseObject, o: CompletionOutput, prompt_tokens: int) -> ResponseObject:
    if o.finish_reason == "length":
        response.status, response.incomplete_details = "incomplete", {"reason": "max_output_tokens"}
    else:
        response.status = "completed"
    n = len(o.token_ids)
    response.usage = ResponseUsage(
        input_tokens=prompt_tokens, output_tokens=n, total_tokens=prompt_tokens + n
    )
    return response


async def create_response(ctx: ServingContext, req: ResponsesRequest, raw: Request) -> Any:
    arrival = time.perf_counter()
    refuse_unsupported(req)
    prepared = await prepare_chat(ctx, to_chat_request(req), raw)
    response = _response(req, random_id("resp"), int(time.time()))
    response.model = ctx.response_model(req.model)
    response_id = response.id
    timer = RequestTimer(ctx.metrics, len(prepared.prompt_ids), arrival=arrival)
    lora = ctx.lora_name(req.model)
    outputs = ctx.stream(
        response_id, prepared.prompt_ids, prepared.params, timer, lora_name=lora, streaming=req.stream
    )
    if req.stream:
        first = await race_disconnect(anext(outputs), raw)
        body = _stream(response, prepared.plan, len(prepared.prompt_ids), first, outputs)
        return StreamingResponse(body, media_type="text/event-stream")
    final = (await race_disconnect(last_output(outputs), raw)).outputs[0]
    response.output = output_items(prepared.plan, final)
    return JSONResponse(_finish(response, final, len(prepared.prompt_ids)).model_dump())


# The event that ends a stream, by the response's final status (the Responses streaming protocol).
TERMINAL_EVENTS = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "failed": "response.failed",
}


class _Events:
    """Numbered Responses stream events."""

    def __init__(self) -> None:
        self.number = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.number, **fields}
        self.number += 1
        return sse_event(payload, event=kind)


async def _stream(
    response: ResponseObject,
    plan: ToolPlan,
    prompt_tokens: int,
    first: RequestOutput,
    outputs: AsyncIterator[RequestOutput],
) -> AsyncIterator[str]:
    event, tracker = _Events(), DeltaTracker()
    message_id = random_id("msg")
    streamed = ""  # text already sent as output_text deltas
    response.status = "in_progress"
    yield event("response.created", response=response.model_dump())
    yield event("response.in_progress", response=response.model_dump())
    try:
        output: RequestOutput | None = first
        final = first.outputs[0]
        while output is not None:
            final = output.outputs[0]
            d = tracker.delta(0, final, hold_back=held_back(plan, final.text, tracker.sent(0)))
            if d is not None and d.text and d.finish_reason is None:
                if not streamed:
                    for text in _open_message(event, message_id):
                        yield text
                yield event(
                    "response.output_text.delta",
                    item_id=message_id,
                    output_index=0,
                    content_index=0,
                    delta=d.text,
                    logprobs=[],
                )
                streamed += d.text
            output = await anext(outputs, None)
        items = output_items(plan, final)
        for index, item in enumerate(items):
            if isinstance(item, OutputMessage):
                item.id = message_id
                for text in _close_message(event, item, index, streamed):
                    yield text
            else:
                for text in _function_call(event, item, index):
                    yield text
        response.output = items
        done = _finish(response, final, prompt_tokens)
        yield event(TERMINAL_EVENTS[done.status], response=done.model_dump())
    except APIError as exc:
        response.status = "failed"
        response.error = {"code": exc.code or "server_error", "message": exc.message}
        yield event(TERMINAL_EVENTS["failed"], response=response.model_dump())
    finally:
        await outputs.aclose()


def _open_message(event: _Events, message_id: str, index: int = 0) -> Iterator[str]:
    item = OutputMessage(id=message_id, content=[], status="in_progress")
    yield event("response.output_item.added", output_index=index, item=item.model_dump())
    part = OutputText(text="").model_dump()
    yield event(
        "response.content_part.added", item_id=message_id, output_index=index, content_index=0, part=part
    )


def _close_message(event: _Events, item: OutputMessage, index: int, streamed: str) -> Iterator[str]:
    """The rest of the message's text (what was held back) and its done events."""
    text = item.content[0].text
    if not streamed:
        yield from _open_message(event, item.id, index)
    rest = text[len(streamed) :] if text.startswith(streamed) else ""
    if rest:
        yield event(
            "response.output_text.delta",
            item_id=item.id,
            output_index=index,
            content_index=0,
            delta=rest,
            logprobs=[],
        )
    part = item.content[0].model_dump()
    yield event(
        "response.output_text.done",
        item_id=item.id,
        output_index=index,
        content_index=0,
        text=text,
        logprobs=[],
    )
    yield event("response.content_part.done", item_id=item.id, output_index=index, content_index=0, part=part)
    yield event("response.output_item.done", output_index=index, item=item.model_dump())


def _function_call(event: _Events, item: OutputFunctionCall, index: int) -> Iterator[str]:
    opened = item.model_copy(update={"arguments": "", "status": "in_progress"}).model_dump()
    yield event("response.output_item.added", output_index=index, item=opened)
    args = item.arguments
    yield event("response.function_call_arguments.delta", item_id=item.id, output_index=index, delta=args)
    yield event(
        "response.function_call_arguments.done",
        item_id=item.id,
        output_index=index,
        name=item.name,
        arguments=args,
    )
    yield event("response.output_item.done", output_index=index, item=item.model_dump())


ROUTES = (Route("/v1/responses", "POST", create_response, body=ResponsesRequest, inference=True),)
