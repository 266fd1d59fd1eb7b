"""warning_once: once per (logger, key) until the once-cache is cleared."""

from __future__ import annotations

import logging

from keepwarm_runtime.log_once import clear_once_cache, warning_once


def test_warning_once_per_key_and_clear(caplog):
    logger = logging.getLogger("keepwarm.test.once")
    caplog.set_level(logging.WARNING, logger=logger.name)
    clear_once_cache()
    assert warning_once(logger, "a", "first %s", 1)
    assert not warning_once(logger, "a", "first %s", 2)
    assert warning_once(logger, "b", "second")
    clear_once_cache()
    assert warning_once(logger, "a", "again")
    assert [r.getMessage() for r in caplog.records] == ["first 1", "second", "again"]
    clear_once_cache()
