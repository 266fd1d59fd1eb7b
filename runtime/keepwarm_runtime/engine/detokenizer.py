"""Incremental detokenization and stop-string matching for one sequence.

A sequence's text is the concatenation of what ``step`` returns for each of its tokens in turn, whether
the steps run as the tokens are sampled or later, in one ``catch_up`` (a request that reads its text
only when it finishes: RequestOutputKind.FINAL_ONLY): the same calls in the same order, the same text.

What ``step`` returns is what tokenizers' ``DecodeStream`` returns. Under a byte-level decoder (GPT-2's,
Llama 3's, Qwen's: a text is its tokens' bytes, joined, read as UTF-8) the text a token adds after whole
characters is its own text standing alone, when that is whole characters too; such steps take that
text from a table (``StandaloneTexts``) instead of calling the stream, which decodes its window twice a
step (a decode step of 64 sequences on the 10M model detokenised in 200-215 us that way, 110-120 us
with the table, its caches cold from the forward pass). A token that is not whole
characters on its own (a byte of a longer character, a skipped special token) goes to a new stream,
which from a character boundary on returns what the sequence's one stream would have, and which is let
go once it returns text again (a boundary again). tests/unit/engine/test_detokenizer.py holds the two
to the same texts, step by step.
"""

from __future__ import annotations

from tokenizers.decoders import ByteLevel, DecodeStream


class StandaloneTexts:
    """Each token's text standing alone, decoded once, the first time the token is met; "" for a token
    that is not whole characters on its own (or decodes to nothing). One per engine and
    ``skip_special_tokens``, shared by its sequences: at most a vocabulary's entries."""

    __slots__ = ("backend", "skip_special_tokens", "texts")

    def __init__(self, backend, skip_special_tokens: bool) -> None:
        self.backend, self.skip_special_tokens = backend, skip_special_tokens
        self.texts: dict[int, str] = {}

    @staticmethod
    def for_tokenizer(tokenizer) -> dict[bool, StandaloneTexts] | None:
        """Tables for each ``skip_special_tokens`` when the tokenizer's decoder is byte-level, else
        None (Metaspace and other decoders read a token's neighbours)."""
        backend = getattr(tokenizer, "_tokenizer", None)
        if backend is None or not isinstance(backend.decoder, ByteLevel):
            return None
        return {skip: StandaloneTexts(backend, skip) for skip in (False, True)}

    def learn(self, token_id: int) -> str:
        text = self.backend.decode([token_id], skip_special_tokens=self.skip_special_tokens)
        text = text if text and "\ufffd" not in text else ""
        self.texts[token_id] = text
        return text


class IncrementalDetokenizer:
    """Text grows one token at a time without re-decoding the whole output (tokenizers' DecodeStream,
    with ``standalone`` texts under a byte-level decoder; a prefix/read-offset window for tokenizers
    without a Rust backend)."""

    __slots__ = (
        "backend",
        "fed",
        "ids",
        "prefix_offset",
        "read_offset",
        "skip_special_tokens",
        "standalone",
        "stream",
        "tokenizer",
    )

    def __init__(
        self, tokenizer, skip_special_tokens: bool = True, standalone: StandaloneTexts | None = None
    ):
        """``standalone``: the engine's table for this ``skip_special_tokens``
        (StandaloneTexts.for_tokenizer), or None: every step through the stream."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.backend = getattr(tokenizer, "_tokenizer", None)
        self.standalone = standalone if self.backend is not None else None
        self.stream = None  # with a table: only while the text stands between two characters
        if self.backend is not None and self.standalone is None:
            self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.ids: list[int] = []
        self.fed = 0  # tokens stepped through so far
        self.prefix_offset = 0
        self.read_offset = 0

    def step(self, token_id: int) -> str:
        """Text added by `token_id` ("" while a multi-byte character is incomplete)."""
        self.fed += 1
        standalone = self.standalone
        if standalone is not None and self.stream is None:  # the text so far ends with a whole character
            text = standalone.texts.get(token_id)
            if text is None:
                text = standalone.learn(token_id)
            if text:
                return text
            self.stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        if self.stream is not None:
            text = self.stream.step(self.backend, token_id) or ""
            if text and standalone is not None:
                self.stream = None  # it returned text: a whole character ends it again
            return text
        self.ids.append(token_id)
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)  # noqa: E731
        prefix = decode(self.ids[self.prefix_offset : self.read_offset])
        full = decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix) :]
        return ""

    def catch_up(self, output_ids: list[int]) -> str:
        """The text added by the tokens of ``output_ids`` (a sequence's generated ids) not yet stepped
        through, stepped through now, one by one: the text ``step`` would have returned for them."""
        step = self.step
        return "".join([step(tid) for tid in output_ids[self.fed :]])


def find_stop(text: str, new_chars: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string that ends inside the last `new_chars` characters: (start index, stop)."""
    best = None
    for stop in stops:
        start = max(0, len(text) - new_chars - len(stop) + 1)
        idx = text.find(stop, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best
