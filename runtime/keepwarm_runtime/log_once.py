"""Log a message once per key for the process lifetime, so repeated events cannot flood logs.

The one such mechanism for every layer (standard library only, so the cache client, the engine, audio
and the server all import it without importing each other). The once-cache is process-global on
purpose (a deprecation or a fallback is news once per process, not once per app instance or engine);
keys are per logger, and tests clear them with ``clear_once_cache()``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable

_seen: set[tuple[str, Hashable]] = set()
_lock = threading.Lock()


def warning_once(logger: logging.Logger, key: Hashable, msg: str, *args: object) -> bool:
    """Log ``msg % args`` at WARNING the first time ``(logger, key)`` is seen; True if it was logged."""
    return log_once(logger, logging.WARNING, key, msg, *args, stacklevel=3)


def log_once(
    logger: logging.Logger, level: int, key: Hashable, msg: str, *args: object, stacklevel: int = 2
) -> bool:
    """Like ``warning_once`` at any level; ``stacklevel`` as logging's (2: the caller's line)."""
    entry = (logger.name, key)
    with _lock:
        if entry in _seen:
            return False
        _seen.add(entry)
    logger.log(level, msg, *args, stacklevel=stacklevel)
    return True


def clear_once_cache() -> None:
    """Forget every key seen so far (tests; a config reload)."""
    with _lock:
        _seen.clear()
