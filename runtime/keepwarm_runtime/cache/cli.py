"""`keepwarm cache serve|ls|stats|release`: run the node daemon and inspect it from a shell.

Bad input never ends in a traceback: every command answers it with one line on stderr naming what
is wrong and exits with ``EXIT_BAD_INPUT`` (2). ``serve`` loads each ``--model`` on its own: a model
that fails is logged (and listed as Failed) while the others are served; it exits 2 only when models
were given and none loaded.

``serve`` runs the node process (keepwarm_runtime/node.py): with ``--all-gpus`` (or the test twin
``--fake-gpu``, see cache/gpus.py) one daemon per GPU in this process, each on its own
gpu-<UUID>.sock, with one /metrics for all of them; the node agent drives every one.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import NoReturn

from keepwarm_api.settings import SettingError, add_command, resolve
from keepwarm_runtime.cache.settings import CacheHoldSettings, CacheServeSettings

EXIT_BAD_INPUT = 2


class OneLineErrorParser(argparse.ArgumentParser):
    """Bad flags get one line naming the flag (and exit 2), not a usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: {message} (see --help)\n")


def register(subparsers: argparse._SubParsersAction) -> None:
    cache = subparsers.add_parser("cache", help="node weight cache daemon and inspection")
    sub = cache.add_subparsers(dest="cache_command", required=True, parser_class=OneLineErrorParser)

    add_command(
        sub, "serve", CacheServeSettings, "load checkpoints and serve them over a Unix socket", run_serve
    )
    add_command(
        sub,
        "hold",
        CacheHoldSettings,
        "keep the daemons' arena descriptors so that a crashed daemon restarts warm",
        run_hold,
    )

    for name, help_text in (("ls", "list resident models"), ("stats", "daemon statistics as JSON")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--socket", required=True, help="daemon socket path (e.g. DIR/host.sock)")
        p.set_defaults(handler=run_inspect, cache_cmd=name)
    release = sub.add_parser("release", help="drop a model from the daemon")
    release.add_argument("--socket", required=True)
    release.add_argument("model")
    release.add_argument("--force", action="store_true", help="release even a pinned model")
    release.set_defaults(handler=run_inspect, cache_cmd="release")


def _fail(command: str, message: object) -> int:
    print(f"keepwarm cache {command}: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def run_serve(args: argparse.Namespace) -> int:
    """The handler of `keepwarm cache serve`: resolve the settings once, then run the node process
    (keepwarm_runtime.node: the daemons and, on Kubernetes, the node agent)."""
    from keepwarm_runtime.node import ServeRefused, serve

    try:
        return serve(resolve(CacheServeSettings, args, os.environ))
    except (SettingError, ServeRefused) as exc:
        return _fail("serve", exc)


def run_hold(args: argparse.Namespace) -> int:
    """The handler of `keepwarm cache hold`: the descriptor holder (cache/holder.py) until SIGTERM."""
    from keepwarm_runtime.cache.holder import Holder

    try:
        settings = resolve(CacheHoldSettings, args, os.environ)
        assert settings.socket_dir is not None  # required: resolve() refuses settings without it
        holder = Holder(Path(settings.socket_dir), settings.group)
        holder.start()
    except Exception as exc:  # bad settings, socket dir or group, another uid's holder: one line
        return _fail("hold", exc)
    ended = threading.Event()

    def stop(*_: object) -> None:
        holder.stop()
        ended.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    holder.serve_forever()
    if holder.handed_off:
        from keepwarm_runtime.node import retire

        retire(settings.after_handoff, ended)
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    """`keepwarm cache ls|stats|release`: one request to a daemon, trusting the socket's owner as a
    client does (KEEPWARM_CACHE_TRUSTED_UIDS, read here by cache/env.py)."""
    from keepwarm_runtime.cache.client import CacheAttachError, connect, request
    from keepwarm_runtime.cache.env import trusted_uids
    from keepwarm_runtime.cache.protocol import ProtocolError

    header = {"cmd": "list" if args.cache_cmd == "ls" else args.cache_cmd}
    if args.cache_cmd == "release":
        header |= {"model": args.model, "force": args.force}
    try:
        trusted = trusted_uids(os.environ)
    except SettingError as exc:
        return _fail(args.cache_cmd, exc)
    try:
        with connect(Path(args.socket), timeout_s=10.0, trusted_uids=trusted) as sock:
            reply, fds = request(sock, header)
        for fd in fds:
            os.close(fd)
        if args.cache_cmd == "ls":
            for row in reply["models"]:
                print(format_ls_row(row))
            return 0
    except CacheAttachError as exc:
        return _fail(args.cache_cmd, exc)
    except (ProtocolError, OSError) as exc:
        return _fail(args.cache_cmd, f"{args.socket} is not a keepwarm cache daemon ({exc})")
    except (KeyError, TypeError, ValueError) as exc:
        return _fail(args.cache_cmd, f"unexpected reply from {args.socket}: {type(exc).__name__}: {exc}")
    reply.pop("ok", None)
    print(json.dumps(reply, indent=2))
    return 0


def format_ls_row(m: dict) -> str:
    """One line per model: resident ones with size and key, Failed ones with their reason."""
    if m.get("state") == "Failed":
        return f"{m['name']}\tFailed\t{m['reason']}"
    pin = " pinned" if m["pinned"] else ""
    kind = m.get("kind", "model")
    return (
        f"{m['name']}\t{kind}\t{m['bytes'] / 2**20:.1f} MiB\t{m['tier']}\t{m['key_digest']}{pin}\t{m['path']}"
    )
