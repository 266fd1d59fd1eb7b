"""What a restored parent takes afresh: the pod's start (argv, environment, directory, limits), the
per-pod facts a module may have cached, and every random state.

Every pod restored from one snapshot starts as the same memory: the same seeds in Python's
``random`` (and every other ``random.Random`` that an import created, such as tempfile's name
sequence), numpy's and torch's default generators, multiprocessing's authentication key, OpenSSL's
generator. Left alone, two pods would draw the same "random" numbers; so a restore reseeds each of
them from the kernel (``os.urandom``) before anything runs. What cannot be changed after start is
said where it matters (docs/snapshots.md): the interpreter's hash secret (str hashes; dictionaries
already hold them), the address-space layout and libc's stack and pointer guards, all as for a
forked worker, per snapshot rather than per pod.
"""

from __future__ import annotations

import gc
import logging
import os
import random
import resource
import sys
import time
import warnings
from collections.abc import Mapping

from keepwarm_runtime.snapshot.wire import Context

log = logging.getLogger(__name__)
# Limits a restore brings from the checkpointed process, set back to the pod's (wire.Context.rlimits).
RLIMITS = ("RLIMIT_NOFILE", "RLIMIT_NPROC", "RLIMIT_CORE", "RLIMIT_AS", "RLIMIT_DATA", "RLIMIT_STACK")


def current_rlimits() -> dict[str, list[int]]:
    """This process's limits of RLIMITS, by name (for a Context)."""
    return {
        name: list(resource.getrlimit(getattr(resource, name))) for name in RLIMITS if hasattr(resource, name)
    }


def take_start(context: Context) -> None:
    """Become the pod's process: its argv, environment (os.environ and the C environ), working
    directory, umask and limits."""
    install_environment(context.env)
    sys.argv = list(context.argv)
    os.chdir(context.cwd)
    os.umask(context.umask)
    for name, (soft, hard) in context.rlimits.items():
        if name in RLIMITS and hasattr(resource, name):
            try:
                resource.setrlimit(getattr(resource, name), (soft, hard))
            except (ValueError, OSError) as exc:  # a hard limit above the snapshot's needs privilege
                log.warning(
                    "keeping the snapshot's %s: the pod's %s/%s cannot be set (%s)", name, soft, hard, exc
                )


def install_environment(env: Mapping[str, str]) -> None:
    """Replace the whole environment; os.environ's updates reach the C environ (putenv, unsetenv)."""
    os.environ.clear()
    os.environ.update(env)


def forget_per_pod_facts() -> None:
    """Drop what modules cached about the process that was checkpointed: its host name (platform's
    uname cache) and when logging started (``relativeCreated``)."""
    platform = sys.modules.get("platform")
    if platform is not None and hasattr(platform, "_uname_cache"):
        platform._uname_cache = None
    logging._startTime = time.time()  # type: ignore[attr-defined]


def reseed() -> list[str]:
    """Reseed every random state from the kernel; returns what was reseeded, for the log."""
    done = ["random"]
    random.seed()
    generators = _reseed_instances()
    if generators:
        done.append(f"{generators} other generators")
    tempfile = sys.modules.get("tempfile")
    if tempfile is not None:
        tempfile._name_sequence = None  # type: ignore[attr-defined]  # rebuilt, seeded, on next use
        done.append("tempfile")
    process = sys.modules.get("multiprocessing.process")
    if process is not None:
        process.current_process().authkey = os.urandom(32)
        done.append("multiprocessing authkey")
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
        done.append("numpy")
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()
        done.append("torch")
    ssl = sys.modules.get("ssl")
    if ssl is not None:
        ssl.RAND_add(os.urandom(64), 64.0)
        done.append("OpenSSL")
    return done


def fingerprints() -> dict[str, str]:
    """A short digest of each random state this process holds (after ``reseed``): logged by a restored
    parent, so that pods restored from one snapshot can be seen to differ. One-way: a digest tells
    nothing of the state."""
    import hashlib
    import tempfile

    def digest(data: object) -> str:
        return hashlib.sha256(repr(data).encode()).hexdigest()[:12]

    out = {"random": digest(random.getstate()), "tempfile": digest(next(tempfile._get_candidate_names()))}
    process = sys.modules.get("multiprocessing.process")
    if process is not None:
        out["authkey"] = digest(bytes(process.current_process().authkey))
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        out["numpy"] = digest(numpy.random.get_state()[1].tobytes())
    torch = sys.modules.get("torch")
    if torch is not None:
        out["torch"] = digest(torch.initial_seed())
    return out


_remembered: list[object] | None = None  # the generators remember_generators() found, else None


def remember_generators() -> int:
    """Before the checkpoint: find every generator an import made, so that a restore's ``reseed`` need
    not search the heap on the pod's start (gc.get_objects() over ~480,000 objects after torch and
    transformers: 0.08-0.09 s). Nothing runs between this and the dump; returns how many."""
    global _remembered
    _remembered = _generators()
    return len(_remembered)


def _generators() -> list[object]:
    """Every ``random.Random`` and numpy generator alive but the module's own (``random.seed`` does
    that one); SystemRandom draws from the kernel and has no state."""
    numpy = sys.modules.get("numpy")
    kinds: tuple[type, ...] = (random.Random,)
    if numpy is not None:
        kinds += (numpy.random.RandomState, numpy.random.Generator)
    with warnings.catch_warnings():  # isinstance() on deprecated proxies (torch.distributed's) warns
        warnings.simplefilter("ignore")
        found = [obj for obj in gc.get_objects() if isinstance(obj, kinds)]
    return [
        obj
        for obj in found
        if not isinstance(obj, random.SystemRandom) and obj is not random._inst  # type: ignore[attr-defined]
    ]


def _reseed_instances() -> int:
    """Reseed every generator an import made: those remembered before the checkpoint, else a search."""
    numpy = sys.modules.get("numpy")
    found = _remembered if _remembered is not None else _generators()
    for obj in found:
        if isinstance(obj, random.Random) or (
            numpy is not None and isinstance(obj, numpy.random.RandomState)
        ):
            obj.seed()
        else:  # a numpy Generator: a fresh bit generator's state, of its own type
            obj.bit_generator.state = type(obj.bit_generator)().state  # type: ignore[attr-defined]
    return len(found)
