"""Structured outputs: JSON schema, regex, choice and grammar constraints as per-token masks.

Built on xgrammar rather than llguidance because xgrammar ships CPU wheels that need no Rust
toolchain, compiles a grammar once per tokenizer into a reusable ``CompiledGrammar`` (cached by the
compiler, so 20 requests with one schema compile it once), and its matcher fills a packed bitmask
that ``apply_token_bitmask_inplace`` applies to a logits row on CPU or GPU — exactly the engine's
``TokenConstraint.fill_mask`` hook. vLLM's default backend is also xgrammar, so grammars written for
vLLM behave the same here.

The engine calls the factory once per output sequence; each call gets a fresh matcher over the shared
compiled grammar.

xgrammar silently ignores some JSON-schema keywords (measured against its matcher: ``not``,
``uniqueItems``, ``if``/``then``/``else``, ``dependentRequired``/``dependentSchemas``, the
exclusivity of ``oneOf``, ``allOf`` merges, unknown ``format`` values, ``format`` or ``pattern`` next
to a length bound, and string/number bounds on a schema without a ``type``). Such a schema goes to
llguidance (``structured_guidance``) when it can enforce it exactly, and is otherwise refused with
the keyword and its location named (``unenforceable_keyword``): never served loosely.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from keepwarm_runtime.engine.sampling_params import TokenConstraint
from keepwarm_runtime.engine.structured_guidance import LLGuidanceBackend

try:  # optional extra: keepwarm-runtime[structured]
    import xgrammar as xgr
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    xgr = None
    _IMPORT_ERROR: ImportError | None = exc
else:
    _IMPORT_ERROR = None


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One request's constraint; exactly one field is set (``json_object`` counts as set when True)."""

    json: dict[str, Any] | str | None = None  # a JSON schema (dict or its JSON text)
    regex: str | None = None  # the whole output must match this regular expression
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # EBNF (GBNF-style, rule `root`) or Lark grammar text
    json_object: bool = False  # any valid JSON object
    any_whitespace: bool = False  # allow free whitespace in JSON (off: compact separators, fewer tokens)

    def kinds(self) -> list[str]:
        """Names of the constraint fields that are set."""
        names = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        return names + (["json_object"] if self.json_object else [])


class XGrammarConstraint:
    """A ``TokenConstraint`` over one compiled grammar: one matcher, one bitmask row."""

    def __init__(self, compiled: Any, vocab_size: int) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._vocab_size = vocab_size

    def fill_mask(self, logits_row: torch.Tensor) -> None:
        """Set the logits of tokens the grammar forbids next to -inf, in place."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        bitmask = self._bitmask.to(logits_row.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits_row.view(1, -1), bitmask, vocab_size=self._vocab_size)

    def accept(self, token_id: int) -> bool:
        """Advance the matcher; False means the token broke the grammar (should not happen after a mask)."""
        if self._matcher.is_terminated():
            return False
        return self._matcher.accept_token(int(token_id))

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


class StructuredOutputCompiler:
    """Compiles request constraints for one tokenizer into factories of fresh constraints.

    ``vocab_size`` is the model's logits width (may exceed the tokenizer's: padded lm_head).
    ``stop_token_ids`` are the ids that end a constrained output (default: the tokenizer's EOS).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int] | None = None) -> None:
        if xgr is None:
            raise ImportError(
                "structured outputs need xgrammar; install the extra: "
                "pip install 'keepwarm-runtime[structured]'"
            ) from _IMPORT_ERROR
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=True)
        self._vocab_size = vocab_size
        self._guidance = LLGuidanceBackend.create(tokenizer, vocab_size, list(stop_token_ids or []))
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams) -> Any:
        """Compile ``params`` (cached by xgrammar); raises ValueError naming what is wrong."""
        kinds = params.kinds()
        if len(kinds) != 1:
            raise ValueError(
                f"structured outputs need exactly one of json, regex, choice, grammar, json_object; got "
                f"{', '.join(kinds) or 'none'}"
            )
        kind = kinds[0]
        try:
            with self._lock:
                return self._compile(kind, params)
        except ValueError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError and friends for bad input
            raise ValueError(f"invalid structured outputs {kind}: {_first_line(exc)}") from exc

    def factory(self, params: StructuredOutputsParams) -> Callable[[], TokenConstraint]:
        """A zero-argument callable the engine calls once per output sequence.

        A JSON schema xgrammar would enforce only loosely goes to llguidance when it can enforce it
        exactly; otherwise the ValueError names the keyword and llguidance's reason."""
        schema = _schema_dict(params.json) if params.json is not None and len(params.kinds()) == 1 else None
        problem = unenforceable_keyword(schema) if schema is not None else None
        if problem is not None:
            if self._guidance is None:
                raise ValueError(f"structured outputs json: {problem}")
            try:
                with self._lock:
                    return self._guidance.json_factory(schema, params.any_whitespace)
            except ValueError as exc:
                raise ValueError(f"structured outputs json: {problem} (llguidance: {exc})") from exc
        compiled = self.compile(params)
        vocab_size = self._vocab_size
        return lambda: XGrammarConstraint(compiled, vocab_size)

    def _compile(self, kind: str, params: StructuredOutputsParams) -> Any:
        if kind == "json_object":  # OpenAI's json_object means an object, not any JSON value
            schema = '{"type": "object"}'
            return self._compiler.compile_json_schema(schema, any_whitespace=params.any_whitespace)
        if kind == "json":
            schema = _schema_dict(params.json)
            problem = unenforceable_keyword(schema)
            if problem is not None:
                raise ValueError(f"structured outputs json: {problem}")
            return self._compiler.compile_json_schema(
                json.dumps(bounded_strings_as_patterns(schema)),
                any_whitespace=params.any_whitespace,
                strict_mode=True,
            )
        if kind == "regex":
            try:
                re.compile(params.regex)
            except re.error as exc:
                raise ValueError(f"invalid structured outputs regex: {exc}") from exc
            return self._compiler.compile_regex(params.regex)
        if kind == "choice":
            if not params.choice or not all(isinstance(c, str) and c for c in params.choice):
                raise ValueError("invalid structured outputs choice: give a list of non-empty strings")
            alternatives = " | ".join(json.dumps(c) for c in params.choice)
            return self._compiler.compile_grammar(f"root ::= {alternatives}")
        grammar = params.grammar or ""
        if "::=" in grammar:
            return self._compiler.compile_grammar(grammar)
        return self._compiler.compile_lark(grammar)


def _schema_dict(schema: dict[str, Any] | str | None) -> dict[str, Any]:
    """The schema as a dict; ValueError when it is not JSON or not an object."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"invalid structured outputs json: schema is not JSON ({exc})") from exc
    if not isinstance(schema, dict):
        raise ValueError("invalid structured outputs json: the schema must be a JSON object")
    return schema


UNENFORCED_KEYWORDS = frozenset(
    {"not", "uniqueItems", "if", "then", "else", "dependentRequired", "dependentSchemas", "allOf", "oneOf"}
    | {"$dynamicRef", "$recursiveRef"}
)
ENFORCED_FORMATS = frozenset(
    {
        "date",
        "time",
        "date-time",
        "duration",
        "email",
        "hostname",
        "ipv4",
        "ipv6",
        "uri",
        "uri-reference",
        "uuid",
    }
)
_STRING_BOUNDS = ("minLength", "maxLength")
_TYPED_KEYWORDS = {
    "minLength": {"string"},
    "maxLength": {"string"},
    "pattern": {"string"},
    "format": {"string"},
    "minimum": {"integer", "number"},
    "maximum": {"integer", "number"},
    "exclusiveMinimum": {"integer", "number"},
    "exclusiveMaximum": {"integer", "number"},
    "multipleOf": {"integer", "number"},
}
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "contains")
_SUBSCHEMA_ONE += ("propertyNames",)
_SUBSCHEMA_LISTS = ("anyOf", "prefixItems", "items")


def unenforceable_keyword(schema: Any, where: str = "the schema root") -> str | None:
    """The first keyword xgrammar would ignore, as "`kw` at <location> ...", or None."""
    if not isinstance(schema, dict):
        return None
    for keyword in schema:
        if keyword in UNENFORCED_KEYWORDS:
            return (
                f"the keyword `{keyword}` (at {where}) cannot be enforced by the grammar backend (xgrammar); "
                "remove it or express it with anyOf/enum/pattern"
            )
    fmt = schema.get("format")
    if fmt is not None and fmt not in ENFORCED_FORMATS:
        supported = ", ".join(sorted(ENFORCED_FORMATS))
        return f"`format: {fmt}` (at {where}) is not enforced; supported formats: {supported}"
    bounds = [k for k in _STRING_BOUNDS if k in schema]
    for other in ("format", "pattern"):
        if other in schema and bounds:
            return f"`{other}` together with `{bounds[0]}` (at {where}) cannot be enforced; keep one of them"
    types = schema.get("type")
    types = {types} if isinstance(types, str) else set(types or [])
    for keyword, needs in _TYPED_KEYWORDS.items():
        if keyword in schema and not types & needs and "enum" not in schema and "const" not in schema:
            return f"`{keyword}` (at {where}) is only enforced with `type: {' or '.join(sorted(needs))}`"
    for key in _SUBSCHEMA_MAPS:
        children = schema.get(key)
        if isinstance(children, dict):
            for name, child in children.items():
                if (found := unenforceable_keyword(child, f"{where} > {key} > {name}")) is not None:
                    return found
    for key in _SUBSCHEMA_ONE:
        if (found := unenforceable_keyword(schema.get(key), f"{where} > {key}")) is not None:
            return found
    for key in _SUBSCHEMA_LISTS:
        children = schema.get(key)
        if isinstance(children, list):
            for i, child in enumerate(children):
                if (found := unenforceable_keyword(child, f"{where} > {key}[{i}]")) is not None:
                    return found
    return None


def bounded_strings_as_patterns(schema: Any) -> Any:
    """Rewrite ``{"type": "string", "minLength": a, "maxLength": b}`` as an equivalent ``pattern``.

    xgrammar (<= 0.2.9) lowers length-bounded strings to a bare character class that admits raw
    control characters (invalid JSON) and no escapes (mlc-ai/xgrammar#800); its ``pattern`` path is
    JSON-string aware. Strings that already have a pattern, format, enum or const are left alone.
    """
    if isinstance(schema, list):
        return [bounded_strings_as_patterns(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: bounded_strings_as_patterns(value) for key, value in schema.items()}
    bounded = "minLength" in out or "maxLength" in out
    if out.get("type") == "string" and bounded and not ({"pattern", "format", "enum", "const"} & out.keys()):
        low, high = int(out.pop("minLength", 0)), out.pop("maxLength", None)
        out["pattern"] = f"^[^\\x00-\\x1f]{{{low},{'' if high is None else int(high)}}}$"
    return out


_NATIVE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # "[09:55:39] /project/cpp/x.cc:82: "


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return _NATIVE_PREFIX.sub("", text.splitlines()[0])[:300]
