"""When this process started, from /proc: a start-up clock that needs no import beyond the standard
library (the snapshot launcher reads it before anything heavy, the server's metrics after)."""

from __future__ import annotations

import os
import time


def process_start_time() -> float:
    """Wall-clock time this process started, or now when /proc is unavailable.

    From /proc/self/stat's start (clock ticks since boot) and /proc/uptime (seconds since boot, to the
    hundredth) against the wall clock now: /proc/stat's ``btime`` is whole seconds, up to a second off."""
    try:
        with open("/proc/self/stat") as f:
            # Field 22 (starttime, clock ticks since boot); the comm field may contain spaces.
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        now = time.time()
        return now - max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()
