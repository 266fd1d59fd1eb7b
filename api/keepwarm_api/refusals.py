"""Clients a node's cache daemon refused, as the daemon counts them and its agent reports them.

Standard library only: the daemon (cache/security.py) imports this on machines without pydantic. The
agent turns the latest episode into the WeightCacheNode condition PeersRefused
(weightcachenode.refusal_condition) while it is recent.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

# A refusal keeps PeersRefused True this long; refusals closer together than this are one episode.
REFUSAL_WINDOW_S = 600


@dataclass(frozen=True)
class Refusals:
    """One episode of refused clients: refusals less than REFUSAL_WINDOW_S apart."""

    count: int
    since: dt.datetime  # the episode's first refusal
    last_at: dt.datetime
    reason: str  # the last refusal in words (cache.security.PeerPolicy.refusal)

    def recent(self, now: dt.datetime) -> bool:
        return (now - self.last_at).total_seconds() < REFUSAL_WINDOW_S

    def wire(self) -> dict[str, Any]:
        """As the daemon's `stats` reply carries it (JSON)."""
        return {
            "count": self.count,
            "since": self.since.isoformat(),
            "lastAt": self.last_at.isoformat(),
            "reason": self.reason,
        }

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Refusals:
        since, last_at = dt.datetime.fromisoformat(data["since"]), dt.datetime.fromisoformat(data["lastAt"])
        return cls(int(data["count"]), since, last_at, str(data["reason"]))


def record(latest: Refusals | None, reason: str, at: dt.datetime) -> Refusals:
    """The episode after one more refusal at `at`: the same one, or a new one after a quiet window."""
    if latest is None or not latest.recent(at):
        return Refusals(count=1, since=at, last_at=at, reason=reason)
    return Refusals(count=latest.count + 1, since=latest.since, last_at=at, reason=reason)
