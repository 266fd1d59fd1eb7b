"""`keepwarm` command line: one subcommand group per subsystem.

Each subsystem owns a ``register(subparsers)`` function in its own module; this file only wires them
together. The registering modules import only what their flags need (settings declarations), so
that `keepwarm --help` stays fast; heavy imports happen in the handlers. A command line that names
its subcommand (`keepwarm cache serve ...`) registers only that subcommand's module: a restarted cache
daemon does not import the inference server's settings to parse its own flags (issue 34).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# subcommand -> the module whose ``register(subparsers) -> None`` adds it (and only it)
SUBCOMMAND_MODULES: dict[str, str] = {
    "make-model": "keepwarm_runtime.modelgen.cli",
    "cache": "keepwarm_runtime.cache.cli",
    "bench": "keepwarm_runtime.bench_cli",
    "serve": "keepwarm_runtime.server.cli",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or with ``only`` (a key of SUBCOMMAND_MODULES) just that subcommand."""
    parser = argparse.ArgumentParser(prog="keepwarm", description="keepwarm runtime")
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    subparsers = parser.add_subparsers(dest="command", required=True)
    names = [only] if only is not None else list(SUBCOMMAND_MODULES)
    for name in names:
        importlib.import_module(SUBCOMMAND_MODULES[name]).register(subparsers)
    return parser


def named_subcommand(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names, if it is one of ours; None for anything else (``--help``, a
    typo: the whole parser then answers, listing every subcommand)."""
    tokens = iter(argv)
    for token in tokens:
        if token == "--log-level":
            next(tokens, None)
        elif not token.startswith("--log-level="):
            return token if token in SUBCOMMAND_MODULES else None
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(named_subcommand(sys.argv[1:] if argv is None else argv))
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
