"""The server's streams beside the same requests unstreamed: what writing a chunk per token costs.

    .venv/bin/python -m bench.streams [--params 10M] [--dtype float32] [--requests 64]
        [--output-tokens 128] [--rounds 3] [--threads 1] [--endpoint completions] [--dir DIR]
        [--json-out FILE]

One ``keepwarm serve`` of a generated Llama (--params, made once, or kept in --dir) gets --requests
requests at once (``--endpoint completions``: token-id prompts of 32 tokens; ``chat``: a user message
of 16 words through the chat template; greedy, EOS ignored, --output-tokens each), sent
by httpx's async client from this process, in --rounds rounds of two runs each: streamed
(``stream: true``, a chunk a token a request while the stream keeps up with the engine, built from
DELTA outputs) and not streamed (one response a request), the order alternating between rounds. Per
run: output tokens/s, the chunks (``messages``; responses when not streamed), the requests whose
usage did not count --output-tokens (``length_mismatches``, 0 unless something is wrong) and the
serving process's CPU seconds by thread over the run (/proc): ``event_loop`` (the
main thread, which parses requests and writes every chunk), ``engine`` (the busiest other thread:
the engine's, whose steps wait for the interpreter lock while the event loop holds it) and
``event_loop_us_per_token``; ``server_io`` is the event loop and HTTP parser the server's log
names. The client shares this machine's CPUs with the server, so compare the runs of one sitting,
streamed beside unstreamed. /proc counts CPU in ticks (10 ms), so runs of a few tokens say nothing.
Linux only. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from keepwarm_runtime.bench_cli import publish

PROMPT_TOKENS = 32
PROMPT_WORDS = 16
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
TICKS = os.sysconf("SC_CLK_TCK")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", default="10M", help="generated model size")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--requests", type=int, default=64, help="requests at once (the server's --max-num-seqs)")
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="the server's intra-op threads")
    p.add_argument("--endpoint", default="completions", choices=sorted(ENDPOINTS))
    p.add_argument("--dir", default=None, help="where the generated model is kept (default: a temporary one)")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    if min(args.requests, args.output_tokens, args.rounds, args.threads) < 1:
        p.error("--requests, --output-tokens, --rounds and --threads must be at least 1")
    return args


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of ``pid`` so far."""
    seconds = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        seconds[int(tid)] = (int(fields[11]) + int(fields[12])) / TICKS
    return seconds


def cpu_by_role(pid: int, before: dict[int, float], after: dict[int, float]) -> dict[str, float]:
    """The run's CPU seconds of the event loop's thread (the main one) and the engine's (the busiest
    other), and of the rest together."""
    spent = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    loop = spent.pop(pid, 0.0)
    engine_tid = max(spent, key=spent.__getitem__, default=None)
    engine = spent.pop(engine_tid, 0.0) if engine_tid is not None else 0.0
    return {"event_loop": round(loop, 2), "engine": round(engine, 2), "other": round(sum(spent.values()), 2)}


async def one_request(
    client, url: str, index: int, tokens: int, stream: bool, endpoint: str = "completions"
) -> tuple[int, int]:
    """Send one request: (chunks or responses that carried text or a finish, the tokens its usage
    counts). A stream behind the engine sends several tokens in a chunk, so the two may differ."""
    if endpoint == "chat":
        words = " ".join(f"w{(index * 7 + i) % 997}" for i in range(PROMPT_WORDS))
        prompt: dict = {"messages": [{"role": "user", "content": words}]}
    else:
        prompt = {"prompt": [10 + (index * 7 + i) % 8000 for i in range(PROMPT_TOKENS)]}
    body = {
        "model": "bench",
        **prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    messages, generated = 0, 0
    async with client.stream("POST", url + ENDPOINTS[endpoint], json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            payload = line.removeprefix("data: ")
            if not payload.startswith("{"):
                continue
            message = json.loads(payload)
            messages += bool(message["choices"])
            generated += (message.get("usage") or {}).get("completion_tokens", 0)
    return messages, generated


async def run_once(url: str, pid: int, args: argparse.Namespace, stream: bool) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=args.requests + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await one_request(client, url, 10_000, 4, stream, args.endpoint)  # a connection and the route warmed
        before, started = thread_cpu(pid), time.perf_counter()
        tokens, endpoint = args.output_tokens, args.endpoint
        sends = (one_request(client, url, i, tokens, stream, endpoint) for i in range(args.requests))
        answers = await asyncio.gather(*sends)
        seconds, after = time.perf_counter() - started, thread_cpu(pid)
    cpu = cpu_by_role(pid, before, after)
    return {
        "stream": stream,
        "tokens_per_s": round(args.requests * args.output_tokens / seconds, 1),
        "seconds": round(seconds, 2),
        "messages": sum(m for m, _ in answers),  # chunks streamed (with text or a finish), or responses
        "length_mismatches": sum(generated != args.output_tokens for _, generated in answers),
        "cpu_s": cpu,
        "event_loop_us_per_token": round(cpu["event_loop"] / (args.requests * args.output_tokens) * 1e6, 1),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from bench.step import machine
    from keepwarm_runtime.modelgen import make_model
    from keepwarm_runtime.server.launcher import start_server

    with tempfile.TemporaryDirectory(prefix="keepwarm-bench-streams-") as tmp:
        root = Path(args.dir or tmp)
        model_dir = root / f"llama-{args.params}-{args.dtype}"
        if not (model_dir / "config.json").exists():
            make_model(model_dir, arch="llama", params=args.params, dtype=args.dtype)
        server_args = ["--served-model-name", "bench", "--dtype", args.dtype, "--threads", str(args.threads)]
        server_args += ["--max-num-seqs", str(args.requests), "--no-supervise"]
        server = start_server(model_dir, Path(tmp) / "serve.log", args=server_args)
        try:
            server.wait(timeout=300)
            named = re.search(r"event loop (\w+), HTTP (\w+)\)", server.log_text())
            io = dict(zip(("event_loop", "http"), named.groups(), strict=True)) if named else None
            rounds = []
            for r in range(args.rounds):
                order = (True, False) if r % 2 == 0 else (False, True)
                runs = [asyncio.run(run_once(server.url, server.worker_pid(), args, s)) for s in order]
                rounds.append(sorted(runs, key=lambda run: not run["stream"]))  # streamed first
                print(f"round {r + 1}: {json.dumps(rounds[-1])}", file=sys.stderr, flush=True)
        finally:
            server.stop()
    publish(
        {
            "benchmark": "streams",
            "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "model": {"arch": "llama", "params": args.params, "dtype": args.dtype},
            "endpoint": args.endpoint,
            "requests": args.requests,
            "output_tokens": args.output_tokens,
            "server_threads": args.threads,
            "server_io": io,
            "machine": machine(),
            "rounds": rounds,
        },
        args.json_out,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
