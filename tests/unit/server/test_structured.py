"""xgrammar constraints over the real generated tokenizer: masked random walks always parse."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from keepwarm_runtime.engine.structured import (
    StructuredOutputCompiler,
    StructuredOutputsParams,
    unenforceable_keyword,
)
from keepwarm_runtime.modelgen.tokenizer import END_OF_TURN, build_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "ok", "color"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(8192)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    stop = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(END_OF_TURN)]
    return StructuredOutputCompiler(tokenizer, vocab_size=len(tokenizer) + 64, stop_token_ids=stop)


def _walk(tokenizer, factory, seed: int, max_steps: int = 200) -> tuple[str, bool]:
    """Sample from random logits under the constraint, as the engine's sampler would."""
    constraint = factory()
    generator = torch.Generator().manual_seed(seed)
    ids = []
    for _ in range(max_steps):
        logits = torch.randn(len(tokenizer) + 64, generator=generator)  # padded lm_head
        constraint.fill_mask(logits)
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        assert token < len(tokenizer), "a padded id slipped through the mask"
        constraint.accept(token)
        ids.append(token)  # as the engine does: the terminating token is part of the output
        if constraint.is_terminated():  # after a stop token (xgrammar) or the last one possible (llguidance)
            return tokenizer.decode(ids, skip_special_tokens=True), True
    return tokenizer.decode(ids, skip_special_tokens=True), False


@pytest.mark.parametrize("seed", range(20))
def test_json_schema_outputs_validate(tokenizer, compiler, seed):
    text, terminated = _walk(tokenizer, compiler.factory(StructuredOutputsParams(json=SCHEMA)), seed)
    assert terminated, text
    jsonschema.validate(json.loads(text), SCHEMA)


def test_regex_choice_grammar_and_json_object(tokenizer, compiler):
    regex = compiler.factory(StructuredOutputsParams(regex=r"[a-z]{2,4}-[0-9]{2}"))
    choice = compiler.factory(StructuredOutputsParams(choice=["yes", "no", "maybe"]))
    grammar = compiler.factory(StructuredOutputsParams(grammar='root ::= "(" ("a" | "b")+ ")"'))
    for seed in range(5):
        assert re.fullmatch(r"[a-z]{2,4}-[0-9]{2}", _walk(tokenizer, regex, seed)[0])
        assert _walk(tokenizer, choice, seed)[0] in {"yes", "no", "maybe"}
        text, terminated = _walk(tokenizer, grammar, seed, max_steps=400)
        assert re.fullmatch(r"\((a|b)+\)", text) and terminated, text
    text, _ = _walk(tokenizer, compiler.factory(StructuredOutputsParams(json_object=True)), 0, max_steps=5)
    assert text.startswith("{")


@pytest.mark.parametrize(
    "params, match",
    [
        (StructuredOutputsParams(json={"type": "nonsense"}), "json"),
        (StructuredOutputsParams(json="{not json"), "not JSON"),
        (StructuredOutputsParams(regex="(["), "regex"),
        (StructuredOutputsParams(grammar="root ::= ("), "grammar"),
        (StructuredOutputsParams(choice=[]), "choice"),
        (StructuredOutputsParams(), "exactly one"),
        (StructuredOutputsParams(regex="a", choice=["a"]), "exactly one"),
    ],
)
def test_invalid_constraints_raise_value_error(compiler, params, match):
    with pytest.raises(ValueError, match=match):
        compiler.factory(params)


@pytest.mark.parametrize(
    "schema, named",
    [
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
        ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "not"),
        ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if"),
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
        ({"type": "string", "format": "frobnicate"}, "format: frobnicate"),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ],
)
def test_keywords_neither_backend_enforces_are_refused_by_name(compiler, schema, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        compiler.factory(StructuredOutputsParams(json=schema))


FALLBACK_SCHEMAS = [
    {"allOf": [{"type": "integer", "minimum": 3}, {"type": "integer", "maximum": 9}]},
    {"type": "string", "pattern": "^a+$", "minLength": 2, "maxLength": 4},
    {"type": "string", "format": "date", "maxLength": 10},
    {"type": "object", "properties": {"n": {"minimum": 3}}, "required": ["n"], "additionalProperties": False},
]


@pytest.mark.parametrize("schema", FALLBACK_SCHEMAS)
@pytest.mark.parametrize("seed", range(5))
def test_schemas_xgrammar_would_loosen_are_enforced_by_llguidance(tokenizer, compiler, schema, seed):
    assert unenforceable_keyword(schema) is not None  # xgrammar alone would serve these loosely
    text, terminated = _walk(tokenizer, compiler.factory(StructuredOutputsParams(json=schema)), seed)
    assert terminated, text
    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


def test_enforced_keywords_compile(compiler):
    schema = {
        "type": "object",
        "properties": {
            "when": {"type": "string", "format": "date"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
            "n": {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "null"}]},
        },
        "required": ["when"],
    }
    assert unenforceable_keyword(schema) is None
    compiler.factory(StructuredOutputsParams(json=schema))
