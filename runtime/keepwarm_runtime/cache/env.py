"""The node cache client's KEEPWARM_CACHE_* variables, for a process without settings of its own.

``attach()`` reads no environment: `keepwarm serve` declares these variables as its cache settings
(server/settings.py, resolved once into its EngineConfig) and passes their values, and the operator sets
them on pods (``keepwarm_api.podenv``). A library user of ``attach()`` that wants the same behaviour
reads them here, in one place: ``cache_client_settings()``; `keepwarm cache ls|stats|release` read
KEEPWARM_CACHE_TRUSTED_UIDS with ``trusted_uids()``.

Unset and empty (or blank) mean the same: the default (``keepwarm_api.settings.present``).
``1/true/yes/on`` and ``0/false/no/off`` (any case) are the only boolean values, and uids are
comma-separated integers (a repeatable setting's variable); anything else is refused by name
(SettingError) rather than guessed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from keepwarm_api import podenv
from keepwarm_api.settings import env_value, parse_bool, present, repeated
from keepwarm_api.values import CacheMode

FALLBACK_ENV = podenv.CACHE_FALLBACK
SOCKET_DIR_ENV = podenv.CACHE_SOCKET_DIR
MODE_ENV = podenv.CACHE_MODE
TRUSTED_UIDS_ENV = podenv.CACHE_TRUSTED_UIDS


@dataclass(frozen=True)
class CacheClientSettings:
    """``attach()``'s cache arguments, by their names there."""

    socket_dir: str | None = None  # the node cache's socket directory; None: load from disk
    mode: str = CacheMode.ZERO_COPY.value  # a CacheMode: zero-copy views of the arena, or a private copy
    fallback: bool = True  # load from disk when the cache cannot serve the model
    trusted_uids: frozenset[int] = frozenset()  # besides this process's uid and root: may own the socket


def cache_client_settings(environ: Mapping[str, str] = os.environ) -> CacheClientSettings:
    """KEEPWARM_CACHE_SOCKET_DIR, KEEPWARM_CACHE_MODE, KEEPWARM_CACHE_FALLBACK and
    KEEPWARM_CACHE_TRUSTED_UIDS, each unset or empty meaning its default; a boolean or uid that does
    not parse raises SettingError (a ValueError) naming the variable."""
    default = CacheClientSettings()
    return CacheClientSettings(
        socket_dir=env_text(SOCKET_DIR_ENV, default.socket_dir, environ),
        mode=env_text(MODE_ENV, None, environ) or default.mode,
        fallback=env_flag(FALLBACK_ENV, default.fallback, environ),
        trusted_uids=trusted_uids(environ),
    )


def trusted_uids(environ: Mapping[str, str] = os.environ) -> frozenset[int]:
    """KEEPWARM_CACHE_TRUSTED_UIDS: comma-separated uids; unset or empty is none."""
    return env_value(TRUSTED_UIDS_ENV, repeated(frozenset, int), frozenset(), environ)


def env_flag(name: str, default: bool, environ: Mapping[str, str] = os.environ) -> bool:
    """``environ[name]`` as a boolean; unset or empty is ``default``; other words raise ValueError."""
    return env_value(name, parse_bool, default, environ)


def env_text(name: str, default: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """``environ[name]`` stripped; unset or empty is ``default`` (the same rule as ``env_flag``)."""
    value = present(environ.get(name))
    return default if value is None else value
