"""The node cache client's KEEPWARM_CACHE_* variables, read by the settings layer's one rule.

Unset and empty (or blank) mean the same: the default (``keepwarm_api.settings.present``).
``1/true/yes/on`` and ``0/false/no/off`` (any case) are the only boolean values; anything else is
refused by name rather than guessed. ``attach()`` reads these names; ``keepwarm serve`` declares the
same ones as its cache settings, and the operator sets them on pods (``keepwarm_api.podenv``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from keepwarm_api import podenv
from keepwarm_api.settings import env_value, parse_bool, present

FALLBACK_ENV = podenv.CACHE_FALLBACK
SOCKET_DIR_ENV = podenv.CACHE_SOCKET_DIR
MODE_ENV = podenv.CACHE_MODE


def env_flag(name: str, default: bool, environ: Mapping[str, str] = os.environ) -> bool:
    """``environ[name]`` as a boolean; unset or empty is ``default``; other words raise ValueError."""
    return env_value(name, parse_bool, default, environ)


def env_text(name: str, default: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """``environ[name]`` stripped; unset or empty is ``default`` (the same rule as ``env_flag``)."""
    value = present(environ.get(name))
    return default if value is None else value
