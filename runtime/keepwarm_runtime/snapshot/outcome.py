"""How this `keepwarm serve` parent came to be: restored from a snapshot, or by importing, and why.

The launcher (restore.py) decides once per process and records it here; a supervised worker inherits
the record by the fork and exports it: ``keepwarm_startup_source_total{source, reason}`` and, after a
restore, ``keepwarm_startup_phase_seconds{phase="restore"}`` (server/base/metrics.py). Reasons are a
closed set (label values); the log line beside each says the specifics (which key field differed,
which file changed, CRIU's own error).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Source(StrEnum):
    SNAPSHOT = "snapshot"  # the parent was restored from a node-local snapshot
    IMPORTS = "imports"  # the parent imported the serving path itself (as without snapshots)


class Reason(StrEnum):
    HIT = "hit"  # restored (source snapshot)
    OFF = "off"  # no snapshot store configured (--snapshot-store unset)
    UNSUPERVISED = "unsupervised"  # --no-supervise: only a supervising parent is snapshotted
    NO_CRIU = "no_criu"  # no CRIU binary, or it does not run
    ABSENT = "absent"  # the store holds no snapshot at all
    MISMATCH = "mismatch"  # no snapshot with this key (the nearest one's differing fields are logged)
    MANIFEST = "manifest"  # the snapshot's manifest is unreadable or malformed
    FILES = "files"  # a file the snapshot maps differs here (another image)
    DIGEST = "digest"  # the snapshot's bytes differ from its recorded digest (corrupt, truncated)
    RESTORE_FAILED = "restore_failed"  # CRIU failed, was killed or timed out
    RESUME_FAILED = "resume_failed"  # the restored parent did not take its context in time
    RESTORED_EXITED = "restored_exited"  # the restored parent failed unasked: the pod imports in its place


# Misses that may mean a damaged snapshot: a pod says so when it asks for one, and the agent checks it
# again in full and takes it anew when it does not hold up (a restore that failed otherwise would
# fail again, so that one is kept).
BROKEN = (Reason.DIGEST, Reason.MANIFEST, Reason.FILES)


@dataclass(frozen=True)
class StartupSource:
    source: Source
    reason: Reason
    restore_s: float | None = None  # launcher start to the restored parent resumed (snapshot only)
    key_digest: str = ""  # the snapshot restored, or the key this start looked for


_recorded: StartupSource | None = None


def record(outcome: StartupSource) -> None:
    """Record how this process started (the launcher, or the restored parent)."""
    global _recorded
    _recorded = outcome


def recorded() -> StartupSource | None:
    """How this process (or, in a worker, its parent) started; None when nothing was decided (a
    process that is not `keepwarm serve`'s)."""
    return _recorded
