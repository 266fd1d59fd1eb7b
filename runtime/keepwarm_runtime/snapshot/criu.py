"""CRIU's command lines for keepwarm's snapshots, and running them.

Both sides run CRIU unprivileged (``--unprivileged``: only CAP_CHECKPOINT_RESTORE, plus CAP_SETPCAP
to restore a bounding set) as the uid of the process checkpointed: the node agent dumps a preloaded
parent it started under a pod's uid, and the pod restores it as itself. Cgroups are left alone
(``--manage-cgroups=ignore``): a restored parent belongs to the pod that restored it, and its memory
is charged there. Namespaces are never dumped: the parent shares the dumper's, and is restored into
the restorer's (the pod's PID, mount and UTS namespaces).

The parent's pipes cross the checkpoint: CRIU records each by its inode, and a restore replaces each
with a descriptor of the restorer's (``--inherit-fd fd[N]:pipe:[INODE]``), so the restored parent
writes to the pod's stdout and stderr and reads its context from the launcher. Images and the work
directory (logs, pidfile) are separate, since the store is read-only to the restorer.

The argv builders are pure; ``run`` and ``version`` are the side effects.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CRIU = "criu"  # found on PATH (the runtime image installs it in /usr/local/sbin)
_VERSION = re.compile(r"^Version:\s*(\S+)", re.MULTILINE)


class CriuMissing(Exception):
    """No CRIU binary where one was looked for; the message says where."""


@dataclass(frozen=True)
class CriuRun:
    """One finished CRIU command."""

    code: int  # exit status (negative: killed by that signal; None never: a timeout kills it)
    seconds: float  # wall time
    log_tail: str  # the last lines of CRIU's log, for a one-line reason
    timed_out: bool = False


def locate(criu: str) -> str:
    """The absolute path of ``criu`` (a path, or a name on PATH); CriuMissing when there is none."""
    found = shutil.which(criu)
    if found is None:
        raise CriuMissing(f"no CRIU binary {criu!r} (on PATH or as a path); snapshots need CRIU 4.x")
    return os.path.realpath(found)


@functools.lru_cache(maxsize=8)
def version(criu_path: str) -> str:
    """``criu --version``'s version (part of every snapshot key); CriuMissing when it does not run."""
    try:
        out = subprocess.run(
            [criu_path, "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CriuMissing(f"{criu_path} --version failed: {exc}") from None
    match = _VERSION.search(out)
    if match is None:
        raise CriuMissing(f"{criu_path} --version printed no version: {out.strip()[:200]!r}")
    return match.group(1)


def pipe_id(fd: int) -> str:
    """CRIU's name of the pipe behind ``fd``: ``pipe:[INODE]``."""
    return f"pipe:[{os.fstat(fd).st_ino}]"


def dump_argv(criu_path: str, pid: int, images: Path, work: Path) -> list[str]:
    """Dump process ``pid`` (and kill it) into ``images``; the log goes to ``work``/dump.log."""
    return [
        criu_path, "dump", "--unprivileged", "--tree", str(pid), "--images-dir", str(images),
        "--work-dir", str(work), "--log-file", "dump.log", "-v4", "--manage-cgroups=ignore",
    ]  # fmt: skip


def restore_argv(
    criu_path: str, images: Path, work: Path, inherit: Mapping[int, str], pidfile: Path
) -> list[str]:
    """Restore ``images`` detached (the restored process then belongs to the caller as a subreaper):
    ``inherit`` maps a descriptor of the caller to the pipe it replaces (``pipe:[INODE]``)."""
    argv = [
        criu_path, "restore", "--unprivileged", "--images-dir", str(images), "--work-dir", str(work),
        "--log-file", "restore.log", "-v4", "--restore-detached", "--pidfile", str(pidfile),
        "--manage-cgroups=ignore",
    ]  # fmt: skip
    for fd, resource in sorted(inherit.items()):
        argv += ["--inherit-fd", f"fd[{fd}]:{resource}"]
    return argv


def run(
    argv: Sequence[str], timeout: float, log: Path, pass_fds: Sequence[int] = (), inherit_stdio: bool = False
) -> CriuRun:
    """Run one CRIU command to its end, or kill it after ``timeout`` seconds. ``inherit_stdio``: CRIU
    gets this process's stdout and stderr (a restore hands them to the restored process)."""
    started = time.monotonic()
    stdio = None if inherit_stdio else subprocess.DEVNULL
    proc = subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=stdio,
        stderr=stdio,
        pass_fds=tuple(pass_fds),
        close_fds=True,
    )
    timed_out = False
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
        timed_out = True
    return CriuRun(code, time.monotonic() - started, log_tail(log), timed_out)


def log_tail(log: Path, lines: int = 3) -> str:
    """The last error lines of a CRIU log (its ``Error`` lines when there are any), on one line."""
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError:
        return "no log"
    errors = [line for line in text if "Error" in line or "error" in line]
    return " | ".join(line.strip() for line in (errors or text)[-lines:])[:600]
