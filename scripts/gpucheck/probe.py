"""Import each module named on the command line; print one JSON object {module: "ok" | error}."""

from __future__ import annotations

import importlib
import json
import sys


def main(modules: list[str]) -> int:
    results = {}
    for module in modules:
        try:
            importlib.import_module(module)
            results[module] = "ok"
        except Exception as exc:  # every failure is a finding to report, not a crash of the probe
            results[module] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
