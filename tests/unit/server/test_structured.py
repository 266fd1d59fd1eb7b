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
        if constraint.is_terminated():
            return tokenizer.decode(ids), True
        ids.append(token)
    return tokenizer.decode(ids), False


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
        ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "allOf"),
        ({"type": "string", "format": "frobnicate"}, "format: frobnicate"),
        ({"type": "string", "format": "date", "maxLength": 3}, "format"),
        (
            {"$defs": {"t": {"type": "string", "pattern": "a+", "minLength": 2}}, "$ref": "#/$defs/t"},
            "pattern",
        ),
        ({"minimum": 3}, "minimum"),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ],
)
def test_keywords_xgrammar_would_ignore_are_refused_by_name(compiler, schema, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        compiler.factory(StructuredOutputsParams(json=schema))


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
