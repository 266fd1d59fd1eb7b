"""A daemon's side of its descriptor holder (holder.py): take back, deposit, and know it is there.

* ``recover``, at start after a crash: reclaim what the holder kept for this daemon's socket and
  serve what verifies (adopt.py); the rest is loaded from disk.
* ``deposit``, once the daemon serves and after every change of the resident set: the holder keeps
  exactly what is served.
* ``watch``, a thread while the daemon serves: every ``HOLDER_CHECK_S`` it asks the holder how many
  arenas it keeps (``count``) and deposits again when that is not what the daemon serves, so a holder
  that restarted empty is ready for the next crash without waiting for a load.

Whether the holder answered the last of these is ``keepwarm_cache_holder_connected`` (0/1). Without
one, a crash of the daemon costs a reload of every model from disk: a daemon says so once, as a
WARNING, at its first contact (``recover``, or the first deposit after a hand-off), and again only
when that changes (a holder that comes back or goes away), never on every check.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from keepwarm_runtime.cache import protocol, security
from keepwarm_runtime.cache.adopt import adopt, refuse
from keepwarm_runtime.cache.handoff import HandoffRefused, check_format, record_of
from keepwarm_runtime.cache.holder import count, reclaim, store
from keepwarm_runtime.cache.metrics import HOLDER

if TYPE_CHECKING:
    from keepwarm_runtime.cache.core import DaemonCore

log = logging.getLogger(__name__)
HOLDER_CHECK_S = 5.0  # between two checks that the holder is there and keeps what the daemon serves
_UNANSWERED = (OSError, protocol.ProtocolError, HandoffRefused, security.CacheSecurityError)


class HolderLink:
    def __init__(self, daemon: DaemonCore) -> None:
        self.daemon = daemon
        self.connected: bool | None = None  # whether the holder answered the last contact; None: none yet
        self._lock = threading.Lock()  # one exchange with the holder at a time

    def recover(self) -> None:
        """Take back, verified (adopt.py), what the holder kept for this socket; a daemon without a
        holder, or whose holder does not answer, loads from disk."""
        d = self.daemon
        with self._lock:
            try:
                stream = reclaim(d.socket_dir, d.socket_path.name)
            except _UNANSWERED as exc:
                self._contact(False, f"it did not answer: {exc}")
                return
            self._contact(stream is not None, "there is none")
        if stream is None:
            return
        try:
            if stream.items:
                check_format(stream.head)
                adopt(d, stream, HOLDER)
        except HandoffRefused as exc:
            refuse(d, stream, HOLDER)
            log.warning("taking nothing from the holder: %s; loading from disk", exc)
        finally:
            stream.close()

    def deposit(self) -> None:
        """Replace what the holder keeps for this socket with the arenas served now (no holder: no-op)."""
        with self._lock:
            self._deposit()

    def _deposit(self) -> None:
        d = self.daemon
        items: list[tuple[dict[str, Any], int]] = []
        try:
            now = time.monotonic()
            for model in d.registry.models():
                with contextlib.suppress(OSError):  # dropped meanwhile
                    items.append((record_of(model, now).to_wire(), os.dup(model.arena.fd)))
            stored = store(d.socket_dir, d.socket_path.name, items)
        except _UNANSWERED as exc:
            self._contact(False, f"the deposit failed: {exc}")
            return
        finally:
            for _, fd in items:
                os.close(fd)
        self._contact(stored is not None, "there is none")

    def check(self) -> None:
        """Is the holder there, keeping what this daemon serves? Deposit again when it is not."""
        d = self.daemon
        with self._lock:
            if d.stopping:  # stopped or handed off: what the holder keeps is left as it is
                return
            try:
                held = count(d.socket_dir, d.socket_path.name)
            except _UNANSWERED as exc:
                self._contact(False, f"it did not answer: {exc}")
                return
            if held is None:
                self._contact(False, "it is gone")
                return
            serving = len(d.registry.models())
            if held in (-1, serving):  # -1: a holder from before `count`, which answered
                self._contact(True)
                return
            log.info("the descriptor holder keeps %d of the %d arenas served; depositing them", held, serving)
            self._deposit()

    def watch(self, stop: threading.Event, interval_s: float = HOLDER_CHECK_S) -> None:
        """Deposit what is served now (the daemon has just bound), then ``check`` every ``interval_s``
        until ``stop`` (the daemon's own thread: daemon.py)."""
        step = self.deposit
        while not self.daemon.stopping:
            try:
                step()
            except Exception as exc:  # never the end of the daemon; the next check tries again
                self._contact(False, f"{type(exc).__name__}: {exc}")
            step = self.check
            if stop.wait(interval_s):
                return

    def _contact(self, connected: bool, why: str = "") -> None:
        """Record the outcome of an exchange: the gauge always, a log line when it changed."""
        self.daemon.metrics.holder_connected.set(1 if connected else 0)
        was, self.connected = self.connected, connected
        if was == connected:
            return
        if connected:
            log.info("the descriptor holder answers: a crash of this daemon restarts warm")
        elif was is None:
            log.warning(
                "no descriptor holder in the socket directory (%s): if this daemon crashes, its restart "
                "reloads every model from disk; run `keepwarm cache hold` beside it",
                why,
            )
        else:
            log.warning(
                "the descriptor holder went away (%s): a crash of this daemon now reloads every model "
                "from disk",
                why,
            )
