"""The one rule for reading ``KEEPWARM_*`` boolean settings from the environment.

Unset and empty (or blank) mean the same: the default. ``1/true/yes/on`` and ``0/false/no/off``
(any case) are the only other values; anything else is refused by name rather than guessed.
``attach()`` (KEEPWARM_CACHE_FALLBACK) and ``keepwarm serve`` use this same function.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off"})
FALLBACK_ENV = "KEEPWARM_CACHE_FALLBACK"
SOCKET_DIR_ENV = "KEEPWARM_CACHE_SOCKET_DIR"
MODE_ENV = "KEEPWARM_CACHE_MODE"


def env_flag(name: str, default: bool, environ: Mapping[str, str] = os.environ) -> bool:
    """``environ[name]`` as a boolean; unset or empty is ``default``; other words raise ValueError."""
    raw = environ.get(name)
    if raw is None or not raw.strip():
        return default
    word = raw.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean; use true or false (empty means the default)")


def env_text(name: str, default: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """``environ[name]`` stripped; unset or empty is ``default`` (the same rule as ``env_flag``)."""
    raw = environ.get(name)
    return default if raw is None or not raw.strip() else raw.strip()
