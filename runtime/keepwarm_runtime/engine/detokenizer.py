"""Incremental detokenization and stop-string matching for one sequence.

A sequence's text is the concatenation of what ``step`` returns for each of its tokens in turn, whether
the steps run as the tokens are sampled or later, in one ``catch_up`` (a request that reads its text
only when it finishes: RequestOutputKind.FINAL_ONLY): the same calls in the same order, the same text."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Text grows one token at a time without re-decoding the whole output (tokenizers' DecodeStream;
    a prefix/read-offset window for tokenizers without a Rust backend)."""

    __slots__ = (
        "backend",
        "fed",
        "ids",
        "prefix_offset",
        "read_offset",
        "skip_special_tokens",
        "stream",
        "tokenizer",
    )

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.backend = getattr(tokenizer, "_tokenizer", None)
        self.stream = None
        if self.backend is not None:
            from tokenizers.decoders import DecodeStream

            self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.ids: list[int] = []
        self.fed = 0  # tokens stepped through so far
        self.prefix_offset = 0
        self.read_offset = 0

    def step(self, token_id: int) -> str:
        """Text added by `token_id` ("" while a multi-byte character is incomplete)."""
        self.fed += 1
        if self.stream is not None:
            return self.stream.step(self.backend, token_id) or ""
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
