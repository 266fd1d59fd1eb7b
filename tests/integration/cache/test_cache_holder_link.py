"""A daemon knows whether its descriptor holder is there (issue 38 item 5): real daemon, real holder.

Without a holder the daemon says once, at start, that a crash will reload from disk, and exports
``keepwarm_cache_holder_connected`` 0; a holder started later gets the daemon's arenas at the next
check (it came up empty) and the gauge turns 1; a holder that dies turns it back to 0, with one line
each time, never one per check.
"""

from __future__ import annotations

import time

import torch

from keepwarm_runtime.cache import holder
from keepwarm_runtime.cache.client import attach
from keepwarm_runtime.cache.holder_link import HOLDER_CHECK_S
from keepwarm_runtime.server.launcher import free_port
from tests.integration.cache.probes import metric, wait_for

GAUGE = "keepwarm_cache_holder_connected"
NO_HOLDER = "no descriptor holder in the socket directory"


def test_the_holder_connected_gauge_follows_the_holder(
    daemon_factory, holder_factory, checkpoint_writer, tmp_path
):
    model = checkpoint_writer(tmp_path / "models" / "m", seed=1)
    socket_dir = tmp_path / "wc"
    port = free_port()
    daemon = daemon_factory(socket_dir, [model], "--metrics-port", str(port)).wait_ready()
    wait_for(lambda: metric(port, GAUGE) is not None)
    assert metric(port, GAUGE) == 0
    assert daemon.stderr.count(NO_HOLDER) == 1, daemon.stderr  # said once, at start
    assert "reloads every model from disk" in daemon.stderr

    hold = holder_factory(socket_dir)  # it starts empty: the daemon's check deposits in it
    wait_for(
        lambda: metric(port, GAUGE) == 1 and holder.count(socket_dir, "host.sock") == 1, 30 * HOLDER_CHECK_S
    )
    assert "the descriptor holder answers" in daemon.stderr
    hold.kill()  # SIGKILL: its socket file stays behind, nobody accepts on it
    wait_for(lambda: metric(port, GAUGE) == 0, 30 * HOLDER_CHECK_S)
    time.sleep(2 * HOLDER_CHECK_S)  # more checks without a holder: no more lines
    assert daemon.stderr.count("the descriptor holder went away") == 1, daemon.stderr
    assert daemon.stderr.count(NO_HOLDER) == 1
    # It served throughout.
    assert attach(model, socket_dir, dtype=torch.bfloat16, fallback=False).source == "cache"
    assert daemon.proc.poll() is None and "Traceback" not in daemon.stderr


def test_a_daemon_started_beside_its_holder_says_nothing_of_disk(
    daemon_factory, holder_factory, checkpoint_writer, tmp_path
):
    model = checkpoint_writer(tmp_path / "models" / "m", seed=1)
    socket_dir = tmp_path / "wc"
    holder_factory(socket_dir)
    port = free_port()
    daemon = daemon_factory(socket_dir, [model], "--metrics-port", str(port)).wait_ready()
    wait_for(lambda: metric(port, GAUGE) == 1)
    assert NO_HOLDER not in daemon.stderr and "went away" not in daemon.stderr
