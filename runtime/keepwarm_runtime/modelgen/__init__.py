"""Random-weight Hugging Face checkpoints for tests, benchmarks and the demo (no hub access).

Exports resolve lazily: `keepwarm --help` and `keepwarm serve` import this package's CLI and must not
pay for importing torch and transformers before they bind their port.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "make_model": "keepwarm_runtime.modelgen.checkpoint",
    "parse_param_count": "keepwarm_runtime.modelgen.checkpoint",
    "build_tokenizer": "keepwarm_runtime.modelgen.tokenizer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
