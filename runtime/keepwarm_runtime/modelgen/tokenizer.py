"""A real byte-level BPE tokenizer with a chat template, trained locally in a second or two.

The training text is the Python standard library's own source, so nothing is downloaded. The trained
tokenizer is cached on disk by (vocab size, corpus version), so generating many checkpoints is cheap;
the folder is ``cache_home`` (default: modelgen/settings.py, ``KEEPWARM_CACHE_HOME``).
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from keepwarm_runtime.modelgen import settings

BOS, EOS, PAD, END_OF_TURN = "<s>", "</s>", "<pad>", "<|end|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
SPECIAL_TOKENS = [PAD, BOS, EOS, END_OF_TURN, *ROLE_TOKENS]

# Starts with {{ bos_token }}, like Llama 3's and Gemma's templates: the case where tokenizing the
# rendered chat with add_special_tokens=True would give two BOS tokens.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CORPUS_VERSION = "stdlib-v1"
CORPUS_MAX_BYTES = 3_000_000


def _corpus() -> Iterator[str]:
    """Yield stdlib source files (deterministic order) up to CORPUS_MAX_BYTES."""
    stdlib = Path(os.path.dirname(os.__file__))
    total = 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="ignore")
        total += len(text)
        yield text
        if total >= CORPUS_MAX_BYTES:
            return


def _cache_path(vocab_size: int, root: Path) -> Path:
    tag = hashlib.sha256(f"{CORPUS_VERSION}:{vocab_size}:{sys.version_info[:2]}".encode()).hexdigest()
    return root / "tokenizers" / f"bpe-{vocab_size}-{tag[:12]}.json"


def _train(vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    # Plain encode adds BOS, like Llama's tokenizer does.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, tokenizer.token_to_id(BOS))],
    )
    return tokenizer


def build_tokenizer(vocab_size: int = 8192, cache_home: Path | None = None) -> PreTrainedTokenizerFast:
    """Return a fast tokenizer with BOS/EOS/PAD and the chat template, vocab exactly ``vocab_size``;
    trained once and kept under ``cache_home`` (None: modelgen's setting)."""
    if vocab_size < 512:
        raise ValueError(f"vocab_size must be at least 512 (got {vocab_size})")
    path = _cache_path(vocab_size, cache_home or settings.cache_home())
    if path.exists():
        raw = Tokenizer.from_file(str(path))
    else:
        raw = _train(vocab_size)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        raw.save(str(tmp))
        os.replace(tmp, path)
    # Pad with filler tokens if the corpus ran out of merges, so len(tokenizer) == vocab_size and
    # every id a model can emit decodes.
    missing = vocab_size - raw.get_vocab_size()
    if missing > 0:
        raw.add_tokens([f"<|filler_{i}|>" for i in range(missing)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[END_OF_TURN, *ROLE_TOKENS],
        model_max_length=4096,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
