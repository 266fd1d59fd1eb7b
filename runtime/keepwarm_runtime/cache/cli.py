"""`keepwarm cache serve|ls|stats|release`: run the node daemon and inspect it from a shell."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    cache = subparsers.add_parser("cache", help="node weight cache daemon and inspection")
    sub = cache.add_subparsers(dest="cache_command", required=True)

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
        "--report-to-kubernetes",
        action="store_true",
        help="run the node agent: report to a WeightCacheNode, follow the WeightCache",
    )
    serve.add_argument("--weightcache", default=None, help="WeightCache name (with --report-to-kubernetes)")
    serve.add_argument("--node-name", default=os.environ.get("NODE_NAME"), help="this node's name")
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
        return int(float(num) * units[t[len(num) :]])
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"cannot parse byte count {text!r}; use e.g. 4GiB") from None


def run_serve(args: argparse.Namespace) -> int:
    from keepwarm_runtime.cache.checkpoint import CheckpointError
    from keepwarm_runtime.cache.daemon import CacheDaemon, DaemonConfig
    from keepwarm_runtime.cache.registry import BudgetExceeded
    from keepwarm_runtime.cache.security import CacheSecurityError

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
    )
    try:
        daemon = CacheDaemon(config)
        for path in args.model:
            daemon.add_model(path)
        daemon.bind()
    except (CacheSecurityError, CheckpointError, BudgetExceeded, OSError, ValueError) as exc:
        print(f"keepwarm cache serve: {exc}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, lambda *_: daemon.stop())
    signal.signal(signal.SIGINT, lambda *_: daemon.stop())
    if args.report_to_kubernetes:
        if not (args.weightcache and args.node_name):
            print(
                "keepwarm cache serve: --report-to-kubernetes needs --weightcache and --node-name",
                file=sys.stderr,
            )
            daemon.close()
            return 2
        from keepwarm_runtime.agent.kubernetes import run_agent

        threading.Thread(target=run_agent, args=(daemon, args), daemon=True, name="node-agent").start()
    daemon.serve_forever()
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    from keepwarm_runtime.cache.client import CacheAttachError, connect, request

    header = {"cmd": "list" if args.cache_cmd == "ls" else args.cache_cmd}
    if args.cache_cmd == "release":
        header |= {"model": args.model, "force": args.force}
    try:
        sock = connect(Path(args.socket), timeout_s=10.0)
        with sock:
            reply, _ = request(sock, header)
    except (CacheAttachError, OSError) as exc:
        print(f"keepwarm cache {args.cache_cmd}: {exc}", file=sys.stderr)
        return 1
    if args.cache_cmd == "ls":
        for m in reply["models"]:
            pin = " pinned" if m["pinned"] else ""
            print(
                f"{m['name']}\t{m['bytes'] / 2**20:.1f} MiB\t{m['tier']}\t{m['key_digest']}{pin}\t{m['path']}"
            )
        return 0
    reply.pop("ok", None)
    print(json.dumps(reply, indent=2))
    return 0
