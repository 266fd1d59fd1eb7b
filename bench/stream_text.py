"""What a streamed token costs the server's bookkeeping as the output grows: long outputs (reasoning)
must not cost more a token at their end than at their start.

    .venv/bin/python -m bench.stream_text [--lengths 1000,8000,32000] [--chars 4] [--window 1000]
        [--rounds 3] [--json-out FILE]

A chat stream's work per delta the engine hands back, outside the engine and the socket: the delta put
together with the output so far (``deltas.Accumulated``, which the stream reads), the characters a
tool-call parser holds back (chat's ``held_back``; plans ``none`` and ``hermes``, whose marker never
comes) and the chunk's new text (``DeltaTracker``). Each output is --chars characters a token; per
length and plan, ``us_per_token`` is the time a token of the last --window tokens took, the best of
--rounds; ``growth`` is the longest length's figure over the shortest's (about 1 where a token costs
the same whatever came before it). One thread, no server: compare the lengths of one run. A benchmark,
not a test.
"""

from __future__ import annotations

import argparse
import time
from datetime import UTC, datetime

from keepwarm_runtime.bench_cli import publish
from keepwarm_runtime.engine.outputs import CompletionOutput, RequestOutput
from keepwarm_runtime.server.base.deltas import Accumulated, DeltaTracker
from keepwarm_runtime.server.openai.chat.serving import held_back
from keepwarm_runtime.server.openai.chat.tool_parsers import HermesParser
from keepwarm_runtime.server.openai.chat.tools import ToolPlan

PLANS = {"none": ToolPlan("none", None, None), "hermes": ToolPlan("auto", None, None, parser=HermesParser())}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="1000,8000,32000", help="output lengths in tokens, comma-separated")
    p.add_argument("--chars", type=int, default=4, help="characters a token")
    p.add_argument("--window", type=int, default=1000, help="the last tokens of each output, timed")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    args.lengths = [int(n) for n in args.lengths.split(",")]
    if min(args.lengths) < 1 or args.chars < 1 or args.rounds < 1 or args.window < 1:
        p.error("--lengths, --chars, --window and --rounds must be at least 1")
    args.window = min(args.window, min(args.lengths))
    return args


def stream_seconds(length: int, plan: ToolPlan, chars: int, window: int) -> float:
    """Seconds the last ``window`` of ``length`` deltas took, each put together, held back and sliced."""
    piece = "w" * (chars - 1) + " "
    together, tracker = Accumulated(), DeltaTracker()
    started = 0.0
    for i in range(length):
        if i == length - window:
            started = time.perf_counter()
        last = i == length - 1
        delta = RequestOutput(
            "r", None, [1], [CompletionOutput(0, piece, [i], None, None, "length" if last else None)], last
        )
        output = together.add(delta)
        o = output.outputs[0]
        tracker.delta(0, o, hold_back=held_back(plan, o.text, tracker.sent(0)))
    elapsed = time.perf_counter() - started
    if len(o.text) != length * chars or tracker.sent(0) != length * chars:
        raise SystemExit(f"the stream of {length} tokens put together or sent the wrong text")
    return elapsed


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = []
    for name, plan in PLANS.items():
        for length in args.lengths:
            best = min(stream_seconds(length, plan, args.chars, args.window) for _ in range(args.rounds))
            rows.append({"plan": name, "tokens": length, "us_per_token": round(best / args.window * 1e6, 3)})
    growth = {}
    for name in PLANS:
        mine = [r for r in rows if r["plan"] == name]
        growth[name] = round(mine[-1]["us_per_token"] / mine[0]["us_per_token"], 2)
    result = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "chars_per_token": args.chars,
        "window": args.window,
        "rounds": args.rounds,
        "rows": rows,
        "growth": growth,
    }
    publish(result, args.json_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
