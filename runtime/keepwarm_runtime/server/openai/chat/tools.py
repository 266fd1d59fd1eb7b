"""Tool calling: what a chat request's ``tools``/``tool_choice`` mean for the prompt, the constraint
and the answer.

- ``none``: tools are left out of the prompt and nothing is parsed.
- ``auto`` (the default when tools are given): tools go into the chat template and the answer is
  parsed by the server's ``--tool-call-parser``; without one, ``auto`` is refused (400), because the
  server could not recognise the calls it asked for. ``parallel_tool_calls=false`` keeps the first.
- ``required``: the output is constrained to a JSON array of ``{"name", "parameters"}`` objects, one
  alternative per tool, so it always parses into calls that match a function's schema.
- a named function: the output is constrained to that function's parameters schema.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from keepwarm_runtime.server.base.errors import BadRequest
from keepwarm_runtime.server.openai.chat.protocol import ChatCompletionRequest, ChatTool
from keepwarm_runtime.server.openai.chat.tool_parsers import (
    TOOL_PARSERS,
    ParsedOutput,
    ParsedToolCall,
    ToolParser,
)


@dataclass(frozen=True)
class ToolPlan:
    """How one request uses tools."""

    mode: str  # "none" | "auto" | "required" | "named"
    template_tools: list[dict[str, Any]] | None  # passed to the chat template
    schema: dict[str, Any] | None  # JSON schema forcing the output (required / named)
    function: str | None = None  # the named function
    parser: ToolParser | None = None  # auto: recognises calls in free text
    single: bool = False  # parallel_tool_calls=false: at most one call per answer

    @property
    def forced(self) -> bool:
        return self.schema is not None


def plan_tools(req: ChatCompletionRequest, parser_name: str | None) -> ToolPlan:
    """The request's tool plan; 400 naming ``tools`` or ``tool_choice`` when it cannot be honoured."""
    tools = req.tools or []
    choice = req.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise BadRequest("tool_choice needs a non-empty `tools` list", param="tool_choice")
        return ToolPlan("none", None, None)
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise BadRequest("tool function names must be unique", param="tools")
    template_tools = [t.model_dump(exclude_none=True) for t in tools]
    if choice == "none":
        return ToolPlan("none", None, None)
    if choice is None or choice == "auto":
        if parser_name is None:
            raise BadRequest(
                "tool_choice `auto` needs the server to parse tool calls: start it with --tool-call-parser "
                f"({', '.join(TOOL_PARSERS)}), or send tool_choice `required`, `none` or a named function",
                param="tool_choice",
            )
        parser = TOOL_PARSERS[parser_name]()
        return ToolPlan("auto", template_tools, None, parser=parser, single=not req.parallel_tool_calls)
    if choice == "required":
        schema = _required_schema(tools, single=not req.parallel_tool_calls)
        return ToolPlan("required", template_tools, schema)
    wanted = choice.function.name
    match = next((t for t in tools if t.function.name == wanted), None)
    if match is None:
        raise BadRequest(f"tool_choice names `{wanted}`, which is not in `tools`", param="tool_choice")
    return ToolPlan("named", template_tools, _parameters(match), function=wanted)


def _parameters(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def _required_schema(tools: list[ChatTool], single: bool) -> dict[str, Any]:
    alternatives = [
        {
            "type": "object",
            "properties": {"name": {"enum": [t.function.name]}, "parameters": _parameters(t)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": alternatives}, "minItems": 1}
    if single:
        schema["maxItems"] = 1
    return schema


def parse_output(plan: ToolPlan, text: str) -> ParsedOutput:
    """The answer's content and calls under ``plan``; output that does not parse stays content."""
    if plan.mode == "none":
        return ParsedOutput(text, [])
    if plan.parser is not None:
        parsed = plan.parser.parse(text)
        if plan.single:
            parsed.tool_calls = parsed.tool_calls[:1]
        return parsed
    try:
        data = json.loads(text)
    except ValueError:
        return ParsedOutput(text, [])  # cut short (finish_reason "length"): nothing to call
    if plan.mode == "named":
        return ParsedOutput(None, [ParsedToolCall(plan.function or "", json.dumps(data, ensure_ascii=False))])
    calls = [ParsedToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in data]
    return ParsedOutput(None, calls)


def finish_reason(plan: ToolPlan, parsed: ParsedOutput, engine_reason: str | None) -> str | None:
    """OpenAI's: "tool_calls" when calls were made (but "stop" for a named function), else the engine's."""
    if not parsed.tool_calls or engine_reason is None:
        return engine_reason
    return "stop" if plan.mode == "named" else "tool_calls"


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def message_for_template(message: Any, role: str, text: str) -> dict[str, Any]:
    """One request message as chat templates expect it (tool-call arguments as objects)."""
    out: dict[str, Any] = {"role": role, "content": text}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)},
            }
            for call in message.tool_calls
        ]
    return out


def _arguments(arguments: str | dict[str, Any]) -> Any:
    if isinstance(arguments, dict):
        return arguments
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
