"""`keepwarm cache serve|ls|stats|release`: run the node daemon and inspect it from a shell.

Bad input never ends in a traceback: every command answers it with one line on stderr naming what
is wrong and exits with ``EXIT_BAD_INPUT`` (2). ``serve`` loads each ``--model`` on its own: a model
that fails is logged (and listed as Failed) while the others are served; it exits 2 only when models
were given and none loaded.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from keepwarm_api.settings import SettingError, add_command, carry_over, resolve
from keepwarm_runtime.cache.settings import CacheServeSettings

if TYPE_CHECKING:
    from keepwarm_runtime.cache.daemon import DaemonConfig

log = logging.getLogger("keepwarm_runtime.cache.serve")
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
    """The handler of `keepwarm cache serve`: resolve the settings once, then serve them."""
    try:
        settings = resolve(CacheServeSettings, args, os.environ)
    except SettingError as exc:
        return _fail("serve", exc)
    return serve(settings)


def daemon_config(settings: CacheServeSettings) -> DaemonConfig:
    """The daemon's configuration: the settings' same-named fields, the socket dir and the limits."""
    from keepwarm_runtime.cache.daemon import DaemonConfig
    from keepwarm_runtime.cache.limits import ServerLimits

    assert settings.socket_dir is not None  # required: resolve() refuses settings without it
    limits = ServerLimits(
        settings.max_connections, settings.max_connections_per_uid, settings.request_deadline
    )
    quantization = None if settings.quantization == "none" else settings.quantization
    return carry_over(
        settings, DaemonConfig, socket_dir=Path(settings.socket_dir), limits=limits, quantization=quantization
    )


def serve(settings: CacheServeSettings) -> int:
    """Claim the socket, load the models, serve until SIGTERM; 2 on bad settings or when none loads."""
    from keepwarm_runtime.cache.daemon import CacheDaemon

    if settings.report_to_kubernetes and not (settings.weightcache and settings.node_name):
        return _fail("serve", "--report-to-kubernetes needs --weightcache and --node-name")
    if settings.stall_timeout < 1:
        return _fail("serve", "--stall-timeout must be at least 1 second")
    config = daemon_config(settings)
    try:
        daemon = CacheDaemon(config)
        daemon.claim()  # a second daemon stops here, before loading anything
    except Exception as exc:  # bad tier/device/group/socket dir, no CUDA, lock held: one line
        return _fail("serve", exc)
    loaded = load_initial_models(daemon, list(settings.model), config.quantization)
    if settings.model and not loaded:
        daemon.close()
        return _fail("serve", f"none of the {len(settings.model)} models loaded; see the errors above")
    try:
        daemon.bind()
    except Exception as exc:
        daemon.close()
        return _fail("serve", exc)
    signal.signal(signal.SIGTERM, lambda *_: daemon.stop())
    signal.signal(signal.SIGINT, lambda *_: daemon.stop())
    if settings.report_to_kubernetes:
        from keepwarm_runtime.agent.kubernetes import run_agent

        threading.Thread(target=run_agent, args=(daemon, settings), daemon=True, name="node-agent").start()
    daemon.serve_forever()
    return 0


def load_initial_models(daemon, paths: list[str], quantization: str | None = None) -> list[str]:
    """Load each model without evicting another (quantized online when ``quantization`` is set); a
    failure is an ERROR line (or a WARNING when it only does not fit the budget) and a Failed entry,
    never the end of the daemon."""
    from keepwarm_runtime.cache.registry import BudgetExceeded

    loaded = []
    for path in paths:
        try:
            loaded.append(daemon.add_model(path, evict=False, quantization=quantization))
        except BudgetExceeded as exc:
            log.warning("not loading %s: %s", path, exc)
        except Exception as exc:
            log.error("cannot load %s: %s", path, exc)
    return loaded


def run_inspect(args: argparse.Namespace) -> int:
    from keepwarm_runtime.cache.client import CacheAttachError, connect, request
    from keepwarm_runtime.cache.protocol import ProtocolError

    header = {"cmd": "list" if args.cache_cmd == "ls" else args.cache_cmd}
    if args.cache_cmd == "release":
        header |= {"model": args.model, "force": args.force}
    try:
        with connect(Path(args.socket), timeout_s=10.0) as sock:
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
    return f"{m['name']}\t{m['bytes'] / 2**20:.1f} MiB\t{m['tier']}\t{m['key_digest']}{pin}\t{m['path']}"
