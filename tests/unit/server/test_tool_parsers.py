"""Tool-call parsers: each format's calls and content, malformed calls left as content, safe streaming."""

from __future__ import annotations

import json

import pytest

from keepwarm_runtime.server.openai.chat.tool_parsers import HermesParser, Llama3JsonParser, MistralParser


def _calls(parsed) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


def test_hermes_two_calls_and_leading_content():
    text = (
        'Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>{"name": "time", "arguments": {}}</tool_call>'
    )
    parsed = HermesParser().parse(text)
    assert parsed.content == "Let me check."
    assert _calls(parsed) == [("weather", {"city": "Oslo"}), ("time", {})]


def test_hermes_unterminated_last_call_still_parses_and_broken_json_stays_content():
    parsed = HermesParser().parse('<tool_call>{"name": "f", "arguments": {"x": 1}}')
    assert _calls(parsed) == [("f", {"x": 1})] and parsed.content is None
    broken = '<tool_call>{"name": "f", "argu'
    assert HermesParser().parse(broken).tool_calls == [] and HermesParser().parse(broken).content == broken


def test_llama3_json_with_python_tag_and_several_calls():
    text = '<|python_tag|>{"name": "a", "parameters": {"q": "x"}}; {"name": "b", "parameters": {}}<|eom_id|>'
    assert _calls(Llama3JsonParser().parse(text)) == [("a", {"q": "x"}), ("b", {})]
    plain = Llama3JsonParser().parse("Just words.")
    assert plain.tool_calls == [] and plain.content == "Just words."


def test_mistral_array_after_marker():
    text = 'Sure.[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]</s>'
    parsed = MistralParser().parse(text)
    assert parsed.content == "Sure." and _calls(parsed) == [("add", {"a": 1, "b": 2})]


@pytest.mark.parametrize(
    "parser, text, safe",
    [
        (HermesParser(), "Hello <tool", len("Hello ")),  # "<tool" may begin "<tool_call>"
        (HermesParser(), "Hello <b>", len("Hello <b>")),
        (HermesParser(), "Hi <tool_call>{", len("Hi ")),
        (MistralParser(), "ok [TOOL", len("ok ")),
        (Llama3JsonParser(), ' {"name"', 0),
        (Llama3JsonParser(), "<|python", 0),
        (Llama3JsonParser(), "The answer", len("The answer")),
    ],
)
def test_safe_content_length_holds_back_what_may_start_a_call(parser, text, safe):
    assert parser.safe_content_length(text) == safe


PARSERS = [HermesParser(), MistralParser(), Llama3JsonParser()]


@pytest.mark.parametrize("parser", PARSERS, ids=lambda p: p.name)
def test_a_stream_that_passes_what_it_sent_holds_back_what_a_whole_search_would(parser) -> None:
    """Text streamed a few characters at a time, the marker anywhere (split across chunks, at the
    start, twice, a near miss): the safe length searched from what was sent equals a search of the
    whole text at every chunk, so the stream sends the same."""
    import random

    marker = getattr(parser, "start", None) or parser.tag
    rng = random.Random(7)
    for trial in range(200):
        pieces = ["word ", "<b> ", "[TOOL ", marker[:-1], marker, " ", "{", "\n"]
        text = "".join(rng.choice(pieces) for _ in range(12))
        sent = 0
        for end in range(1, len(text) + 1, rng.randint(1, 5)):
            so_far = text[:end]
            whole = parser.safe_content_length(so_far)
            assert parser.safe_content_length(so_far, sent) == whole, (trial, so_far, sent)
            sent = max(sent, whole)  # what DeltaTracker sends: never takes back what it sent


def test_the_held_end_is_the_longest_that_could_begin_the_marker() -> None:
    """Against the definition, over every end of texts made of the marker's own pieces."""
    import itertools

    from keepwarm_runtime.server.openai.chat.tool_parsers import _held_suffix

    for marker in ("<tool_call>", "[TOOL_CALLS]", "aab"):
        alphabet = [*sorted(set(marker)), "x"]
        for size in range(6):
            for chars in itertools.product(alphabet, repeat=size):
                text = "".join(chars)
                ends = range(min(len(marker) - 1, len(text)) + 1)
                want = max(n for n in ends if marker.startswith(text[len(text) - n :]))
                assert _held_suffix(text, marker) == want, (marker, text)
