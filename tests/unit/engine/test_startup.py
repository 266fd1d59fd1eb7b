"""engine/startup.py: contiguous phases from one origin, unknown phases refused."""

from __future__ import annotations

import time

import pytest

from keepwarm_runtime.engine.startup import PHASES, StartupProfile


def test_phases_are_contiguous_from_the_origin():
    profile = StartupProfile()
    for phase in ("imports", "config", "weights"):
        profile.mark(phase)
    now = time.perf_counter()
    assert list(profile.seconds) == ["imports", "config", "weights"]
    assert profile.total() == pytest.approx(now - profile.origin, abs=0.01)


def test_since_process_start_charges_the_time_before_to_the_first_phase():
    profile = StartupProfile.since_process_start(time.time() - 2.0)
    assert profile.mark("imports") == pytest.approx(2.0, abs=0.05)


def test_summary_names_the_weights_source_and_unknown_phases_are_refused():
    profile = StartupProfile()
    profile.weights_source = "cache"
    profile.mark("weights")
    assert "weights 0.00s (cache)" in profile.summary() and "total" in profile.summary()
    with pytest.raises(ValueError, match="unknown startup phase 'load'"):
        profile.mark("load")
    assert "load" not in PHASES
