"""Serving benchmark: requests/s and time to first token at concurrency 1, 8 and 32, printed as JSON.

Starts one real `keepwarm serve` process on a generated Llama (~100M parameters by default), then for
each concurrency level runs a closed loop of streaming chat requests through the official `openai`
client (each worker sends its next request as soon as the last one finishes). Every request
generates exactly ``--max-tokens`` tokens (``ignore_eos``) so levels are comparable. TTFT is the
time from sending the request to the first content chunk.

Run: ``.venv/bin/python bench/serve.py [--params 100M] [--concurrency 1,8,32]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai

from keepwarm_runtime.server.launcher import start_server

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Summarise the design of a paged KV cache in a few words, then list its trade-offs."


def ensure_model(model_dir: Path, params: str) -> None:
    if (model_dir / "config.json").exists():
        return
    command = [sys.executable, "-m", "keepwarm_runtime.cli", "make-model", str(model_dir), "--params", params]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


async def one_request(client: openai.AsyncOpenAI, seed: int, max_tokens: int) -> tuple[float, float, int]:
    """(ttft_s, e2e_s, tokens) of one streaming chat request."""
    started = time.perf_counter()
    ttft, tokens = None, 0
    stream = await client.chat.completions.create(
        model="bench",
        messages=[{"role": "user", "content": f"{PROMPT} ({seed})"}],
        max_tokens=max_tokens,
        seed=seed,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content and ttft is None:
            ttft = time.perf_counter() - started
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return (ttft if ttft is not None else float("nan")), time.perf_counter() - started, tokens


async def run_level(url: str, concurrency: int, num_requests: int, max_tokens: int) -> dict:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=600)
    queue = list(range(num_requests))
    results: list[tuple[float, float, int]] = []

    async def worker() -> None:
        while queue:
            seed = queue.pop()
            results.append(await one_request(client, seed, max_tokens))

    started = time.perf_counter()
    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await client.close()
    wall = time.perf_counter() - started
    ttfts = [r[0] for r in results]
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(results) / wall, 3),
        "output_tokens_per_s": round(sum(r[2] for r in results) / wall, 1),
        "ttft_p50_s": round(percentile(ttfts, 50), 4),
        "ttft_p99_s": round(percentile(ttfts, 99), 4),
        "e2e_p50_s": round(statistics.median(r[1] for r in results), 4),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="100M", help="generated model size (default 100M)")
    parser.add_argument("--model-dir", type=Path, default=None, help="default: out/bench/llama-<params>")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument(
        "--requests-per-worker", type=int, default=2, help="requests = max(8, this x concurrency)"
    )
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()

    model_dir = args.model_dir or REPO / "out" / "bench" / f"llama-{args.params}"
    ensure_model(model_dir, args.params)
    levels = [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory(prefix="keepwarm-bench-") as tmp:
        server_args = [
            "--served-model-name",
            "bench",
            "--dtype",
            args.dtype,
            "--max-num-seqs",
            str(max(levels)),
        ]
        server = start_server(
            model_dir, Path(tmp) / "serve.log", args=[*server_args, "--kv-cache-memory-gib", "1"]
        )
        try:
            ready_s = server.wait("/ready", timeout=300)
            asyncio.run(run_level(server.url, 1, 2, args.max_tokens))  # warm-up: first-call costs
            results = [
                asyncio.run(run_level(server.url, c, max(8, args.requests_per_worker * c), args.max_tokens))
                for c in levels
            ]
        finally:
            server.stop()
    report = {
        "benchmark": "serve",
        "model": {"arch": "llama", "params": args.params, "dtype": args.dtype},
        "max_tokens": args.max_tokens,
        "server_ready_s": round(ready_s, 2),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "device": "cpu"},
        "levels": results,
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
