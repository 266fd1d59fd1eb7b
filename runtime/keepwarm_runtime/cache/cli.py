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
import math
import os
import signal
import sys
import threading
from pathlib import Path
from typing import NoReturn

from keepwarm_runtime.agent.kubernetes import MAX_LOADS, STALL_TIMEOUT_S

log = logging.getLogger("keepwarm_runtime.cache.serve")
EXIT_BAD_INPUT = 2


class OneLineErrorParser(argparse.ArgumentParser):
    """Bad flags get one line naming the flag (and exit 2), not a usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: {message} (see --help)\n")


def register(subparsers: argparse._SubParsersAction) -> None:
    cache = subparsers.add_parser("cache", help="node weight cache daemon and inspection")
    sub = cache.add_subparsers(dest="cache_command", required=True, parser_class=OneLineErrorParser)

    serve = sub.add_parser("serve", help="load checkpoints and serve them over a Unix socket")
    serve.add_argument("--model", action="append", default=[], metavar="DIR", help="checkpoint dir (repeat)")
    serve.add_argument("--socket-dir", required=True, help="e.g. /var/run/keepwarm/<weightcache>")
    serve.add_argument("--tier", default="auto", choices=["auto", "gpu", "host"])
    serve.add_argument("--device", default="cuda:0", help="gpu tier: which GPU (default cuda:0)")
    serve.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["float32", "bfloat16", "float16"],
        help="serving dtype of floating tensors (clients must ask for the same)",
    )
    serve.add_argument("--budget", type=_bytes, default=None, help="bytes (or 4GiB, 512MiB); LRU beyond")
    serve.add_argument("--pin", action="append", default=[], metavar="NAME", help="never evict NAME")
    serve.add_argument("--group", default=None, help="share the socket with this group (0770/0660)")
    serve.add_argument("--allow-uid", action="append", type=int, default=[], help="peer uid to allow")
    serve.add_argument("--allow-gid", action="append", type=int, default=[], help="peer gid to allow")
    serve.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics here")
    serve.add_argument(
        "--max-connections",
        type=_positive_int,
        default=None,
        help="open client connections, in all (default: 256, fewer under a low open-files limit)",
    )
    serve.add_argument(
        "--max-connections-per-uid", type=_positive_int, default=32, help="open client connections per uid"
    )
    serve.add_argument(
        "--request-deadline",
        type=_positive_float,
        default=10.0,
        metavar="SECONDS",
        help="a whole request frame must arrive within this time from its first byte",
    )
    serve.add_argument(
        "--report-to-kubernetes",
        action="store_true",
        help="run the node agent: follow this node's WeightCacheNode spec, report into its status",
    )
    serve.add_argument("--weightcache", default=None, help="WeightCache name (with --report-to-kubernetes)")
    serve.add_argument("--node-name", default=os.environ.get("NODE_NAME"), help="this node's name")
    serve.add_argument(
        "--max-loads",
        type=int,
        default=MAX_LOADS,
        metavar="N",
        help="node agent: downloads/loads in flight at once",
    )
    serve.add_argument(
        "--stall-timeout",
        type=float,
        default=STALL_TIMEOUT_S,
        metavar="SECONDS",
        help="node agent: a Hub download adding no bytes for this long is stopped (and retried later)",
    )
    serve.set_defaults(handler=run_serve)

    for name, help_text in (("ls", "list resident models"), ("stats", "daemon statistics as JSON")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--socket", required=True, help="daemon socket path (e.g. DIR/host.sock)")
        p.set_defaults(handler=run_inspect, cache_cmd=name)
    release = sub.add_parser("release", help="drop a model from the daemon")
    release.add_argument("--socket", required=True)
    release.add_argument("model")
    release.add_argument("--force", action="store_true", help="release even a pinned model")
    release.set_defaults(handler=run_inspect, cache_cmd="release")


def _bytes(text: str) -> int:
    units = {
        "": 1,
        "B": 1,
        "K": 1 << 10,
        "KIB": 1 << 10,
        "M": 1 << 20,
        "MIB": 1 << 20,
        "G": 1 << 30,
        "GIB": 1 << 30,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
    }
    t = text.strip().upper()
    num = t.rstrip("KMGIB")
    try:
        value = float(num) * units[t[len(num) :]]
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"cannot parse byte count {text!r}; use e.g. 4GiB") from None
    if not math.isfinite(value) or value < 1 or value > 2**63:
        raise argparse.ArgumentTypeError(f"byte count {text!r} must be a finite, positive size, e.g. 4GiB")
    return int(value)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def _fail(command: str, message: object) -> int:
    print(f"keepwarm cache {command}: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def run_serve(args: argparse.Namespace) -> int:
    from keepwarm_runtime.cache.daemon import CacheDaemon, DaemonConfig
    from keepwarm_runtime.cache.limits import ServerLimits

    if args.report_to_kubernetes and not (args.weightcache and args.node_name):
        return _fail("serve", "--report-to-kubernetes needs --weightcache and --node-name")
    if args.max_loads < 1 or args.stall_timeout < 1:
        return _fail("serve", "--max-loads and --stall-timeout must be at least 1")
    config = DaemonConfig(
        socket_dir=Path(args.socket_dir),
        tier=args.tier,
        device=args.device,
        dtype=args.dtype,
        budget=args.budget,
        pins=frozenset(args.pin),
        group=args.group,
        allow_uids=frozenset(args.allow_uid),
        allow_gids=frozenset(args.allow_gid),
        metrics_port=args.metrics_port,
        limits=ServerLimits(args.max_connections, args.max_connections_per_uid, args.request_deadline),
    )
    try:
        daemon = CacheDaemon(config)
        daemon.claim()  # a second daemon stops here, before loading anything
    except Exception as exc:  # bad tier/device/group/socket dir, no CUDA, lock held: one line
        return _fail("serve", exc)
    loaded = load_initial_models(daemon, args.model)
    if args.model and not loaded:
        daemon.close()
        return _fail("serve", f"none of the {len(args.model)} models loaded; see the errors above")
    try:
        daemon.bind()
    except Exception as exc:
        daemon.close()
        return _fail("serve", exc)
    signal.signal(signal.SIGTERM, lambda *_: daemon.stop())
    signal.signal(signal.SIGINT, lambda *_: daemon.stop())
    if args.report_to_kubernetes:
        from keepwarm_runtime.agent.kubernetes import run_agent

        threading.Thread(target=run_agent, args=(daemon, args), daemon=True, name="node-agent").start()
    daemon.serve_forever()
    return 0


def load_initial_models(daemon, paths: list[str]) -> list[str]:
    """Load each model without evicting another; a failure is an ERROR line (or a WARNING when it
    only does not fit the budget) and a Failed entry, never the end of the daemon."""
    from keepwarm_runtime.cache.registry import BudgetExceeded

    loaded = []
    for path in paths:
        try:
            loaded.append(daemon.add_model(path, evict=False))
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
