"""IncrementalDetokenizer against tokenizers' own DecodeStream, step by step: the standalone-text table
of a byte-level tokenizer changes how a step's text is found, never what it is."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerFast

from keepwarm_runtime.engine.detokenizer import IncrementalDetokenizer, StandaloneTexts
from keepwarm_runtime.modelgen import build_tokenizer

TEXTS = [
    "def main():\n    return 0\n",
    "héllo wörld, ça va? 日本語のテキスト 🦙🔥 Ελληνικά",
    "naïve café — “quotes” … ½ ∑ ≠ 𝄞𐍈",
]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    tok = build_tokenizer(8192)
    tok.add_tokens(["日本語", "<|plain|>"])  # added tokens that are not special, one not ASCII
    return tok


def _odd_ids(tok: PreTrainedTokenizerFast) -> list[int]:
    """Ids that are not whole characters on their own (bytes of longer characters), and the specials."""
    backend = tok._tokenizer
    partial = [i for i in range(len(tok)) if "\ufffd" in backend.decode([i], skip_special_tokens=False)]
    return partial + tok.all_special_ids + tok.convert_tokens_to_ids(["日本語", "<|plain|>"])


def _sequences(tok: PreTrainedTokenizerFast, count: int) -> list[list[int]]:
    rng = random.Random(3)
    odd, vocab = _odd_ids(tok), len(tok)
    encoded = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    out = []
    for n in range(count):
        ids = list(encoded[n % len(encoded)])
        for _ in range(rng.randrange(0, 12)):  # odd ids and random ones dropped in anywhere
            ids.insert(
                rng.randrange(0, len(ids) + 1),
                rng.choice(odd) if rng.random() < 0.6 else rng.randrange(vocab),
            )
        out.append(ids)
    out.append([rng.choice(odd) for _ in range(200)])  # nothing but bytes of characters and specials
    out.append([rng.randrange(vocab) for _ in range(400)])
    return out


@pytest.mark.parametrize("skip", [True, False])
def test_every_step_returns_what_decode_stream_returns(tokenizer, skip: bool) -> None:
    tables = StandaloneTexts.for_tokenizer(tokenizer)
    assert tables is not None  # byte-level: the table is in use
    backend = tokenizer._tokenizer
    for ids in _sequences(tokenizer, 120):
        reference = DecodeStream(skip_special_tokens=skip)
        detok = IncrementalDetokenizer(tokenizer, skip, tables[skip])
        for i, tid in enumerate(ids):
            expected = reference.step(backend, tid) or ""
            assert detok.step(tid) == expected, (ids[: i + 1], skip)
    assert tables[skip].texts, "the table learnt no token"


def test_catch_up_is_the_steps_joined(tokenizer) -> None:
    tables = StandaloneTexts.for_tokenizer(tokenizer)
    for ids in _sequences(tokenizer, 20):
        stepped = IncrementalDetokenizer(tokenizer, True, tables[True])
        text = "".join(stepped.step(t) for t in ids)
        assert IncrementalDetokenizer(tokenizer, True, tables[True]).catch_up(ids) == text


def test_a_whole_character_token_after_whole_characters_takes_no_stream(tokenizer) -> None:
    tables = StandaloneTexts.for_tokenizer(tokenizer)
    detok = IncrementalDetokenizer(tokenizer, True, tables[True])
    ids = tokenizer.encode("日本語 and more", add_special_tokens=False)
    text = "".join(detok.step(t) for t in ids)
    assert text == "日本語 and more" and detok.stream is None


def test_a_decoder_that_reads_neighbours_has_no_table() -> None:
    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    raw.train_from_iterator(TEXTS * 4, trainer=trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw)
    assert StandaloneTexts.for_tokenizer(tok) is None
    ids = tok.encode(TEXTS[1], add_special_tokens=False)
    detok, reference = IncrementalDetokenizer(tok, True), DecodeStream(skip_special_tokens=True)
    assert [detok.step(t) for t in ids] == [reference.step(raw, t) or "" for t in ids]
