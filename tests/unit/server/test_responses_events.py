"""The Responses stream's terminal event follows the response's status, parsed by the official `openai`
client's own event types: completed, incomplete (cut off at max_output_tokens) and failed (the engine
failed the request mid-stream)."""

from __future__ import annotations

import asyncio
import json

import pydantic
from openai.types.responses import ResponseStreamEvent

from keepwarm_runtime.engine.outputs import CompletionOutput, RequestOutput
from keepwarm_runtime.server.base.errors import APIError
from keepwarm_runtime.server.openai.chat.tools import ToolPlan
from keepwarm_runtime.server.openai.responses.protocol import ResponseObject
from keepwarm_runtime.server.openai.responses.serving import _stream

EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)


def _output(text: str, finish: str | None) -> RequestOutput:
    completion = CompletionOutput(0, text, list(range(len(text))), None, None, finish_reason=finish)
    return RequestOutput("resp-1", None, [1, 2], [completion], finished=finish is not None)


async def _outputs(items: list[RequestOutput | Exception]):
    for item in items:
        if isinstance(item, Exception):
            raise item
        yield item


def _events(items: list[RequestOutput | Exception], plan: ToolPlan | None = None) -> list:
    plan = plan or ToolPlan("none", None, None)

    async def collect() -> list[str]:
        outputs = _outputs(items[1:])
        return [chunk async for chunk in _stream(ResponseObject(model="m"), plan, 2, items[0], outputs)]

    events = []
    for chunk in asyncio.run(collect()):
        data = next(line for line in chunk.splitlines() if line.startswith("data: "))
        events.append(EVENTS.validate_python(json.loads(data.removeprefix("data: "))))
    return events


def test_a_finished_answer_ends_with_response_completed() -> None:
    events = _events([_output("Hel", None), _output("Hello", "stop")])
    assert events[-1].type == "response.completed" and events[-1].response.status == "completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_an_answer_cut_off_ends_with_response_incomplete() -> None:
    events = _events([_output("Hel", None), _output("Hello", "length")])
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert "response.completed" not in [e.type for e in events]


def test_an_engine_failure_mid_stream_ends_with_response_failed() -> None:
    events = _events([_output("Hel", None), APIError("sampling failed: overflow")])
    terminal = events[-1]
    assert terminal.type == "response.failed" and terminal.response.status == "failed"
    assert "sampling failed" in terminal.response.error.message
    assert {e.type for e in events} & {"response.completed", "response.incomplete"} == set()


def test_a_function_call_item_is_added_then_done_before_response_completed() -> None:
    plan = ToolPlan("named", [], {"type": "object"}, function="weather")
    events = _events([_output('{"city": "Oslo"}', "stop")], plan)
    kinds = [e.type for e in events]
    assert kinds[2:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert (events[2].item.status, events[5].item.status) == ("in_progress", "completed")
    assert events[4].arguments == events[5].item.arguments == '{"city": "Oslo"}'
