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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="keepwarm-operator", description="keepwarm Kubernetes operator")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="watch WeightCaches and InferenceDeployments and reconcile them")
    run.add_argument(
        "--namespace",
        action="append",
        default=[],
        help="serve InferenceDeployments only here (repeatable; default: all)",
    )
    agent_ns = os.environ.get("KEEPWARM_AGENT_NAMESPACE", "keepwarm-system")
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
    resync = float(os.environ.get("KEEPWARM_OPERATOR_RESYNC_SECONDS", 30))
    run.add_argument(
        "--resync-seconds", type=float, default=resync, help="resync period (default: %(default)s)"
    )
    run.add_argument("--kubeconfig", default=None, help="kubeconfig (default: in-cluster, then $KUBECONFIG)")
    run.add_argument("--log-level", default="INFO")
    return parser


def run(args: argparse.Namespace) -> int:
    # Handlers read these at import (timer periods) and at startup (client, namespaces).
    os.environ["KEEPWARM_OPERATOR_RESYNC_SECONDS"] = str(args.resync_seconds)
    os.environ["KEEPWARM_AGENT_NAMESPACE"] = args.agent_namespace
    os.environ["KEEPWARM_OPERATOR_NAMESPACES"] = ",".join(args.namespace)
    if args.kubeconfig:
        os.environ["KUBECONFIG"] = args.kubeconfig
    import kopf
    from prometheus_client import start_http_server

    from . import handlers  # noqa: F401  (registers the handlers)

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
        )
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
