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

from keepwarm_api.settings import SettingError, add_command, resolve

from .settings import OperatorSettings


def build_parser() -> argparse.ArgumentParser:
    """The CLI, generated from OperatorSettings (flags, KEEPWARM_OPERATOR_* variables, --help)."""
    parser = argparse.ArgumentParser(prog="keepwarm-operator", description="keepwarm Kubernetes operator")
    sub = parser.add_subparsers(dest="command", required=True)
    add_command(
        sub, "run", OperatorSettings, "watch WeightCaches and InferenceDeployments and reconcile them"
    )
    return parser


def settings_from(args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> OperatorSettings:
    """The one OperatorSettings of this process; a bad value is a SystemExit naming it."""
    try:
        return resolve(OperatorSettings, args, env)
    except SettingError as exc:
        raise SystemExit(f"keepwarm-operator: {exc}") from None


def run(settings: OperatorSettings) -> int:
    import kopf
    from prometheus_client import start_http_server

    from . import handlers

    handlers.register(settings)  # what depends on settings (timer periods); the rest registers on import

    if settings.metrics_port:
        start_http_server(settings.metrics_port)
    priority = settings.priority if settings.priority is not None else random.randint(1, 1_000_000)
    level = settings.log_level.upper()
    kopf.configure(verbose=level == "DEBUG", quiet=level in ("WARNING", "ERROR"))  # kopf owns logging
    if level != "DEBUG":  # one INFO line per timer tick and object is noise; failures still show
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    asyncio.run(
        kopf.operator(
            clusterwide=not settings.namespaces,
            namespaces=sorted(settings.namespaces),
            standalone=settings.standalone,
            peering_name=None if settings.standalone else settings.peering,
            priority=priority,
            liveness_endpoint=f"http://0.0.0.0:{settings.liveness_port}/healthz",
            memo=kopf.Memo(settings=settings),
        )
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(settings_from(build_parser().parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
