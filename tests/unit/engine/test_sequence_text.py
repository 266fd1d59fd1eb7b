"""A sequence's text kept in pieces (engine/sequence.py): every read is the text the appends make,
whatever the pieces, and the engine's stop search over its end finds what a search of the whole does."""

from __future__ import annotations

import random

import pytest

from keepwarm_runtime.engine import sequence as sequence_module
from keepwarm_runtime.engine.detokenizer import find_stop
from keepwarm_runtime.engine.llm_engine import _find_stop
from keepwarm_runtime.engine.sampling_params import SamplingParams
from keepwarm_runtime.engine.sequence import Sequence


def appended(pieces: list[str]) -> tuple[Sequence, str]:
    seq = Sequence("r", 0, [1], SamplingParams())
    for piece in pieces:
        seq.add_text(piece)
    return seq, "".join(pieces)


@pytest.mark.parametrize("count", [0, 1, 2, 63, 64, 65, 200])
def test_slices_and_the_whole_are_the_appended_text(count) -> None:
    rng = random.Random(count)
    pieces = [
        "".join(rng.choice("ab\u00e9\U0001f600 ") for _ in range(rng.randint(0, 5))) for _ in range(count)
    ]
    seq, want = appended(pieces)
    assert seq.text_len == len(want)
    assert len(seq.text_pieces) <= sequence_module.TEXT_PIECES
    for _ in range(200):
        start = rng.randint(0, len(want))
        end = rng.randint(start, len(want))
        assert seq.text_slice(start, end) == want[start:end]
    assert seq.text_slice(len(want), len(want)) == ""
    assert seq.text == want and seq.text_pieces == ([want] if want or count else [])
    seq.add_text("zz")  # after the whole was read, appends go on
    assert seq.text_slice(len(want), len(want) + 2) == "zz" and seq.text == want + "zz"


def test_cutting_keeps_the_first_characters() -> None:
    seq, want = appended(["hello ", "wor", "ld", "!"])
    seq.cut_text(8)
    assert seq.text == want[:8] and seq.text_len == 8
    seq.add_text("?")
    assert seq.text == "hello wo?" and seq.text_slice(7, 9) == "o?"


@pytest.mark.parametrize("seed", range(20))
def test_the_stop_search_over_the_end_finds_what_the_whole_does(seed) -> None:
    rng = random.Random(seed)
    stops = ["ab", "bba", "a"] if seed % 2 else ["ba\u00e9b", "\U0001f600b"]
    pieces = ["".join(rng.choice("ab\u00e9\U0001f600") for _ in range(rng.randint(1, 4))) for _ in range(150)]
    seq = Sequence("r", 0, [1], SamplingParams())
    whole = ""
    for piece in pieces:
        seq.add_text(piece)
        whole += piece
        assert _find_stop(seq, len(piece), stops) == find_stop(whole, len(piece), stops)
