"""`keepwarm` command line: one subcommand group per subsystem.

Each subsystem owns a ``register(subparsers)`` function in its own module; this file only wires them
together. The registering modules import only what their flags need (settings declarations), so
that `keepwarm --help` stays fast; heavy imports happen in the handlers.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# (module, attribute) pairs; each attribute is ``register(subparsers) -> None``.
SUBCOMMAND_MODULES: list[str] = [
    "keepwarm_runtime.modelgen.cli",
    "keepwarm_runtime.cache.cli",
    "keepwarm_runtime.bench_cli",
    "keepwarm_runtime.server.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="keepwarm", description="keepwarm runtime")
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module_name in SUBCOMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=LOG_FORMAT,
        stream=sys.stderr,
    )
    result = args.handler(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
