"""`python -m keepwarm_runtime.server.checkpoint CONFIG_DIR`: the parent the node agent checkpoints.

It is `keepwarm serve`'s supervising parent up to the point where that parent would bind its ports
(server/cli.py ``supervise``): OpenMP's environment prepared, the serving path of CONFIG_DIR's
config.json preloaded (server/preload.py: imports only, one thread, no CUDA, no tokenizer). Then the
checkpoint point (wire.py): it notes the random generators imports made (fresh.py reseeds them after a
restore without searching the heap), says Ready and blocks reading its control pipe, where the agent dumps
it. A pod that restores it writes its Context there: the restored parent takes its start afresh
(fresh.py), answers RESUMED, and runs `keepwarm serve` with the pod's own argv, which finds
everything imported and goes on as today: settings, bind, fork, serve.

Only the descriptors of wire.py are open at the checkpoint (the agent starts it with no others: a
descriptor into another mount namespace would fail the dump).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time

from keepwarm_runtime.snapshot import fresh
from keepwarm_runtime.snapshot.wire import (
    MAX_CONTEXT_BYTES,
    RESUMED,
    Context,
    MappedFile,
    Ready,
    read_all,
    write_all,
)

log = logging.getLogger("keepwarm_runtime.server.checkpoint")  # also when run as __main__
_PR_SET_PTRACER = 0x59616D61  # "Yama"
_PR_SET_PTRACER_ANY = -1


def mapped_files(maps: str | None = None) -> tuple[MappedFile, ...]:
    """The regular files this process maps (from /proc/self/maps), each with its size and mtime."""
    if maps is None:
        with open("/proc/self/maps") as f:
            maps = f.read()
    paths = dict.fromkeys(
        fields[5]
        for line in maps.splitlines()
        if len(fields := line.split(maxsplit=5)) == 6 and fields[5].startswith("/")
    )
    out = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:  # "(deleted)" and the like: a restore would not find it either
            continue
        if os.path.isfile(path):
            out.append(MappedFile(path, st.st_size, st.st_mtime_ns))
    return tuple(out)


def prepare(config_dir: str, device: str) -> Ready:
    """Everything `keepwarm serve`'s parent does before it binds, for CONFIG_DIR's model on ``device``
    ("cuda" or "cpu")."""
    from keepwarm_runtime.engine import threads as cpu_threads
    from keepwarm_runtime.model_kind import detect_kind
    from keepwarm_runtime.server.cli import prepare_parent_environment
    from keepwarm_runtime.server.preload import preload

    cpu_threads.prepare_openmp(cpu_threads.choose_threads(None))
    prepare_parent_environment()
    seconds = preload(config_dir, detect_kind(config_dir), cuda=device == "cuda")
    return Ready(os.getpid(), seconds, mapped_files())


def checkpoint_point(ready: Ready, control_fd: int, ready_fd: int) -> Context | None:
    """Say Ready, then wait for a context (the agent dumps this process while it waits). None: the
    agent closed the pipe without one (it gave up on this snapshot)."""
    _allow_tracer()
    fresh.remember_generators()
    sys.stdout.flush()
    sys.stderr.flush()
    write_all(ready_fd, ready.encode())
    data = read_all(control_fd, MAX_CONTEXT_BYTES)
    return Context.decode(data) if data else None


def _allow_tracer() -> None:
    """Under Yama's ptrace scope 1, only an ancestor may trace this process, and CRIU (the agent's
    other child) is not one: let any process of this uid trace it (a no-op without Yama)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PTRACER, _PR_SET_PTRACER_ANY, 0, 0, 0)


def resume(context: Context, control_fd: int, ready_fd: int) -> int:
    """After a restore: become the pod's process, reseed, answer RESUMED, run `keepwarm serve`."""
    from keepwarm_runtime.snapshot import outcome

    fresh.take_start(context)
    fresh.forget_per_pod_facts()
    api = "bound here"
    if context.listener is not None:  # the API socket the launcher bound at the pod's start
        from keepwarm_runtime.server import listener
        from keepwarm_runtime.snapshot import handover

        if (sock := handover.receive(context.listener)) is not None:
            listener.adopt(sock)
            api = "the launcher's"
    reseeded = fresh.reseed()
    logging.getLogger().setLevel(context.log_level.upper())
    restore_s = max(0.0, time.time() - context.started_at)
    outcome.record(
        outcome.StartupSource(outcome.Source.SNAPSHOT, outcome.Reason.HIT, restore_s, context.key_digest)
    )
    write_all(ready_fd, RESUMED)
    os.close(ready_fd)
    os.close(control_fd)
    log.info(
        "restored from snapshot %s: %.2fs from the pod's start (restore %.2fs); API socket: %s; "
        "reseeded %s; random state digests: %s",
        context.key_digest,
        restore_s,
        time.time() - context.restore_started_at,
        api,
        ", ".join(reseeded),
        " ".join(f"{name}={value}" for name, value in fresh.fingerprints().items()),
    )
    from keepwarm_runtime.cli import main

    return main(list(context.argv[1:]))


def main(argv: list[str]) -> int:
    import argparse

    from keepwarm_runtime.cli import LOG_FORMAT

    parser = argparse.ArgumentParser(prog="python -m keepwarm_runtime.server.checkpoint")
    parser.add_argument("config_dir", help="a directory holding the model's config.json")
    parser.add_argument("log_level")
    parser.add_argument("--control-fd", type=int, required=True, help="the pipe the context arrives on")
    parser.add_argument("--ready-fd", type=int, required=True, help="the pipe Ready and RESUMED go to")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="what the parent preloads for"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT, stream=sys.stderr)
    context = checkpoint_point(prepare(args.config_dir, args.device), args.control_fd, args.ready_fd)
    if context is None:
        log.info("no snapshot taken: the agent gave up; exiting")
        return 0
    return resume(context, args.control_fd, args.ready_fd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
