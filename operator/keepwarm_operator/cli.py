"""`keepwarm-operator`: run the kopf operator with keepwarm's handlers.

keepwarm-operator run [--namespace NS ...] [--peering NAME | --standalone] [--metrics-port 8080]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import sys
from collections.abc import Mapping

from .settings import ENV_AGENT_NAMESPACE, ENV_RESYNC_SECONDS, ENV_WORKERS, OperatorSettings


def build_parser(env: Mapping[str, str] = os.environ) -> argparse.ArgumentParser:
    """The CLI; KEEPWARM_* variables in `env` supply defaults, flags win."""
    defaults = OperatorSettings()
    parser = argparse.ArgumentParser(prog="keepwarm-operator", description="keepwarm Kubernetes operator")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="watch WeightCaches and InferenceDeployments and reconcile them")
    run.add_argument(
        "--namespace",
        action="append",
        default=[],
        help="serve InferenceDeployments only here (repeatable; default: all)",
    )
    agent_ns = env.get(ENV_AGENT_NAMESPACE) or defaults.agent_namespace
    run.add_argument(
        "--agent-namespace", default=agent_ns, help="namespace of agent DaemonSets (default: %(default)s)"
    )
    run.add_argument("--peering", default="keepwarm", help="ClusterKopfPeering name (default: %(default)s)")
    run.add_argument("--standalone", action="store_true", help="no peering: only for a single replica")
    run.add_argument("--priority", type=int, default=None,
                     help="peering priority; replicas need distinct ones (default: random)")  # fmt: skip
    run.add_argument(
        "--metrics-port", type=int, default=8080, help="/metrics port, 0 to disable (default: %(default)s)"
    )
    run.add_argument("--liveness-port", type=int, default=8081, help="/healthz port (default: %(default)s)")
    resync = float(env.get(ENV_RESYNC_SECONDS) or defaults.resync_seconds)
    run.add_argument(
        "--resync-seconds", type=float, default=resync, help="resync period (default: %(default)s)"
    )
    workers = int(env.get(ENV_WORKERS) or defaults.workers)
    run.add_argument("--workers", type=int, default=workers, help="handler threads (default: %(default)s)")
    run.add_argument("--kubeconfig", default=None, help="kubeconfig (default: in-cluster, then $KUBECONFIG)")
    run.add_argument("--log-level", default="INFO")
    return parser


def settings_from(args: argparse.Namespace) -> OperatorSettings:
    return OperatorSettings(
        agent_namespace=args.agent_namespace,
        namespaces=frozenset(args.namespace),
        resync_seconds=args.resync_seconds,
        workers=args.workers,
        kubeconfig=args.kubeconfig,
    )


def run(args: argparse.Namespace) -> int:
    import kopf
    from prometheus_client import start_http_server

    from . import handlers

    settings = settings_from(args)
    handlers.register(settings)  # what depends on settings (timer periods); the rest registers on import

    if args.metrics_port:
        start_http_server(args.metrics_port)
    priority = args.priority if args.priority is not None else random.randint(1, 1_000_000)
    level = args.log_level.upper()
    kopf.configure(verbose=level == "DEBUG", quiet=level in ("WARNING", "ERROR"))  # kopf owns logging
    if level != "DEBUG":  # one INFO line per timer tick and object is noise; failures still show
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    asyncio.run(
        kopf.operator(
            clusterwide=not args.namespace,
            namespaces=args.namespace,
            standalone=args.standalone,
            peering_name=None if args.standalone else args.peering,
            priority=priority,
            liveness_endpoint=f"http://0.0.0.0:{args.liveness_port}/healthz",
            memo=kopf.Memo(settings=settings),
        )
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
