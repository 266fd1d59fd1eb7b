"""Tool plans: which tool_choice forces which schema, and what each plan makes of the model's text."""

from __future__ import annotations

import json

import jsonschema
import pytest

from keepwarm_runtime.server.base.errors import BadRequest
from keepwarm_runtime.server.openai.chat.protocol import ChatCompletionRequest
from keepwarm_runtime.server.openai.chat.tools import finish_reason, parse_output, plan_tools

ADD = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOLS = [
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
    {"type": "function", "function": {"name": "now"}},
]


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **fields})


def test_required_schema_accepts_exactly_calls_of_the_given_tools():
    plan = plan_tools(request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), None)
    jsonschema.validate([{"name": "add", "parameters": {"a": 1}}], plan.schema)
    for bad in ([], [{"name": "add", "parameters": {}}], [{"name": "sub", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, plan.schema)
    with pytest.raises(jsonschema.ValidationError):  # parallel_tool_calls=False: one call at most
        jsonschema.validate([{"name": "now", "parameters": {}}] * 2, plan.schema)
    parsed = parse_output(plan, json.dumps([{"name": "add", "parameters": {"a": 2}}]))
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("add", {"a": 2})]
    assert finish_reason(plan, parsed, "stop") == "tool_calls"


def test_named_choice_forces_the_function_parameters():
    plan = plan_tools(
        request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}}), None
    )
    assert plan.schema == ADD
    parsed = parse_output(plan, '{"a": 5}')
    assert parsed.content is None and parsed.tool_calls[0].name == "add"
    assert finish_reason(plan, parsed, "stop") == "stop"
    truncated = parse_output(plan, '{"a": ')
    assert truncated.tool_calls == [] and truncated.content == '{"a": '


def test_auto_uses_the_parser_and_keeps_one_call_when_not_parallel():
    plan = plan_tools(request(tools=TOOLS, parallel_tool_calls=False), "hermes")
    text = '<tool_call>{"name": "now", "arguments": {}}</tool_call>' * 2
    assert len(parse_output(plan, text).tool_calls) == 1
    assert plan.template_tools and plan.schema is None


@pytest.mark.parametrize(
    "fields, parser",
    [
        ({"tools": TOOLS}, None),  # auto without a parser
        ({"tool_choice": "required"}, None),  # no tools
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, None),
        ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, None),  # duplicate names
    ],
)
def test_plans_that_cannot_be_honoured_are_refused(fields, parser):
    with pytest.raises(BadRequest):
        plan_tools(request(**fields), parser)


def test_none_leaves_tools_out():
    plan = plan_tools(request(tools=TOOLS, tool_choice="none"), None)
    assert plan.template_tools is None and parse_output(plan, "<tool_call>{}").content == "<tool_call>{}"
