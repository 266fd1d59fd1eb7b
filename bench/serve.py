"""Serving benchmark: `keepwarm serve` vs `transformers serve` under the same open-loop load, printed as JSON.

    .venv/bin/python bench/serve.py [--params 100M] [--dtype bfloat16] [--rates 0.25,0.5,1,2]
        [--duration 20] [--min-requests 8] [--max-prompt-words 256] [--max-output-len 128]
        [--peers keepwarm,transformers] [--rounds 2] [--slo-ttft-p99 2.0] [--seed 0] [--json-out FILE]
        [--transformers-env GOMP_SPINCOUNT=1000]

Both servers serve the same generated Llama (~--params parameters) in the same --dtype on the CPU:

* ``keepwarm``: ``keepwarm serve`` (continuous batching, paged KV);
* ``transformers``: ``transformers serve --continuous-batching`` from the installed transformers (its
  paged continuous batching), run offline (``HF_HUB_OFFLINE=1``) with the model directory's path as
  the model id. Its threads are torch's defaults unless --transformers-env says otherwise (keepwarm
  sizes its own from the CPUs it may use and lets waiting OpenMP threads spin only briefly before
  sleeping: engine/threads.py).

Load, identical for both: at each offered rate, requests arrive as a seeded Poisson process (exponential
gaps) for about --duration seconds (at least --min-requests requests) and are sent when they arrive,
whether or not earlier ones have finished (open loop). Each is a streaming chat request through the
official ``openai`` client with a seeded prompt of 8..--max-prompt-words words and a seeded output
length of 8..--max-output-len tokens, greedy. EOS is ignored so every request generates what it asks
for: keepwarm takes ``ignore_eos``; transformers serve has no such field, so its request carries a
``generation_config`` whose ``eos_token_id`` is -1 (a token that never comes), which its continuous
batching passes per request. Every response's ``usage.completion_tokens`` is checked against the
request's length (``length_mismatches``).

Per rate: the sample's own arrival rate (few requests stray from the offered rate), achieved req/s
(completed requests over first send to last finish), output tokens/s, TTFT (request sent to first
content chunk) and TPOT (time per output token after the first) p50/p99 (nearest rank: with few
requests p99 is the slowest). A rate is sustained when every request finished and TTFT p99 <
--slo-ttft-p99. Rates run in ascending order and a peer stops at its first rate that is not sustained
(in that round): past it the queue only grows. Requests still unfinished 3 x the last arrival + 60 s
after the start are cancelled and count as not finished.

Rounds alternate which server goes first (this machine drifts); each server is started afresh per round
and warmed up with two requests (transformers builds its paged cache on the first). For each peer and
rate the round with the lower TTFT p99 counts; ``sustained_rate`` is the highest rate sustained in a
counted round. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import openai

from keepwarm_runtime.bench_cli import publish
from keepwarm_runtime.server.launcher import ServerStartError, free_port, http_get, start_server

REPO = Path(__file__).resolve().parents[1]
PEERS = ("keepwarm", "transformers")
# Prompt words: the generated tokenizer was trained on English, so these are a token or two each.
VOCABULARY = (
    "cache block page token weight kernel batch queue request stream model layer tensor memory node "
    "pod sequence prefix decode prefill schedule thread core socket shard quota latency budget the a of "
    "and to in is that for on with as by design trade offs summary reason answer question list"
)
WORDS = tuple(VOCABULARY.split())


@dataclass(frozen=True)
class Request:
    at_s: float  # arrival time after the level starts
    prompt: str
    max_tokens: int


@dataclass
class Outcome:
    ttft_s: float = math.nan
    e2e_s: float = math.nan
    finished_at_s: float = math.nan  # after the level started
    tokens: int = 0
    error: str | None = None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", default="100M", help="generated model size (default 100M)")
    p.add_argument("--model-dir", type=Path, default=None, help="default: out/bench/llama-<params>")
    p.add_argument("--dtype", default="bfloat16", help="float32 | bfloat16, for both servers")
    p.add_argument("--rates", default="0.25,0.5,1,2", help="offered request rates, requests/s")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per rate")
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--max-prompt-words", type=int, default=256)
    p.add_argument("--max-output-len", type=int, default=128)
    p.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated, of {', '.join(PEERS)}")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--slo-ttft-p99", type=float, default=2.0, help="seconds")
    p.add_argument(
        "--transformers-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra environment for transformers serve, e.g. GOMP_SPINCOUNT=1000 as keepwarm sets it",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args(argv)
    args.rates = sorted(float(r) for r in args.rates.split(","))
    args.peers = [x for x in args.peers.split(",") if x]
    if set(args.peers) - set(PEERS):
        p.error(f"--peers: unknown {sorted(set(args.peers) - set(PEERS))}; use {', '.join(PEERS)}")
    if any("=" not in kv for kv in args.transformers_env):
        p.error("--transformers-env takes NAME=VALUE")
    args.transformers_env = dict(kv.split("=", 1) for kv in args.transformers_env)
    if args.max_prompt_words < 8 or args.max_output_len < 8 or min(args.rates) <= 0:
        p.error("need --max-prompt-words >= 8, --max-output-len >= 8 and positive --rates")
    return args


def workload(rate: float, args: argparse.Namespace) -> list[Request]:
    """The requests of one rate: seeded by (seed, rate), so every peer and round gets the same."""
    rng = random.Random(f"{args.seed}/{rate}")
    count = max(args.min_requests, round(rate * args.duration))
    at, requests = 0.0, []
    for i in range(count):
        words = rng.choices(WORDS, k=rng.randint(8, args.max_prompt_words))
        requests.append(Request(at, f"({i}) " + " ".join(words), rng.randint(8, args.max_output_len)))
        at += rng.expovariate(rate)
    return requests


def percentile(values: list[float], q: float) -> float:
    """Nearest rank; NaN for no values."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def request_body(peer: str, request: Request) -> dict:
    """Arguments for chat.completions.create: greedy, exactly max_tokens tokens (EOS ignored)."""
    if peer == "keepwarm":
        extra = {"ignore_eos": True}
    else:  # transformers serve: no ignore_eos; an EOS id that never comes, passed per request by its CB
        extra = {"generation_config": json.dumps({"eos_token_id": -1, "do_sample": False})}
    return {
        "messages": [{"role": "user", "content": request.prompt}],
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "extra_body": extra,
    }


async def one_request(
    client: openai.AsyncOpenAI, model: str, peer: str, request: Request, start: float
) -> Outcome:
    await asyncio.sleep(max(0.0, start + request.at_s - time.perf_counter()))
    sent = time.perf_counter()
    outcome, chunks = Outcome(), 0
    try:
        stream = await client.chat.completions.create(model=model, **request_body(peer, request))
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                chunks += 1
                if chunks == 1:
                    outcome.ttft_s = time.perf_counter() - sent
            if chunk.usage is not None:
                outcome.tokens = chunk.usage.completion_tokens
    except openai.OpenAIError as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"[:200]
        return outcome
    outcome.tokens = outcome.tokens or chunks
    now = time.perf_counter()
    outcome.e2e_s, outcome.finished_at_s = now - sent, now - start
    return outcome


async def run_rate(url: str, model: str, peer: str, requests: list[Request], wall_s: float) -> list[Outcome]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=wall_s)
    start = time.perf_counter()
    tasks = [asyncio.create_task(one_request(client, model, peer, r, start)) for r in requests]
    try:
        await asyncio.wait(tasks, timeout=wall_s)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()
    return [
        t.result() if t.done() and not t.cancelled() else Outcome(error="not finished within the wall limit")
        for t in tasks
    ]


def summarise(rate: float, requests: list[Request], outcomes: list[Outcome], slo: float) -> dict:
    done = [o for o in outcomes if o.error is None]
    ttfts = [o.ttft_s for o in done]
    tpots = [(o.e2e_s - o.ttft_s) / (o.tokens - 1) for o in done if o.tokens > 1]
    wall = max((o.finished_at_s for o in done), default=math.nan)
    ttft_p99 = percentile(ttfts, 99)
    errors = sorted({o.error for o in outcomes if o.error})
    return {
        "offered_rate": rate,
        "arrival_rate": round((len(requests) - 1) / requests[-1].at_s, 3),  # this sample's own rate
        "requests": len(requests),
        "completed": len(done),
        "achieved_req_per_s": round(len(done) / wall, 3) if done else 0.0,
        "output_tokens_per_s": round(sum(o.tokens for o in done) / wall, 1) if done else 0.0,
        "ttft_p50_s": round(percentile(ttfts, 50), 3),
        "ttft_p99_s": round(ttft_p99, 3),
        "tpot_p50_s": round(percentile(tpots, 50), 4),
        "tpot_p99_s": round(percentile(tpots, 99), 4),
        "e2e_p50_s": round(percentile([o.e2e_s for o in done], 50), 3),
        "length_mismatches": sum(
            o.tokens != r.max_tokens for r, o in zip(requests, outcomes, strict=True) if o.error is None
        ),
        "sustained": len(done) == len(requests) and ttft_p99 < slo,
        **({"errors": errors[:3]} if errors else {}),
    }


class TransformersServer:
    """`transformers serve --continuous-batching MODEL_DIR` in its own session, offline."""

    def __init__(self, model_dir: Path, dtype: str, log_path: Path, env: dict[str, str]):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        command = [
            str(Path(sys.executable).with_name("transformers")),
            "serve",
            "--continuous-batching",
            "--device",
            "cpu",
            "--dtype",
            dtype,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
            str(model_dir),
        ]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **env}
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.started = time.monotonic()

    def wait(self, timeout: float = 300) -> float:
        deadline = self.started + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(f"transformers serve exited:\n{self.log_path.read_text()[-3000:]}")
            if http_get(self.url + "/health", timeout=1.0)[0] == 200:
                return time.monotonic() - self.started
            time.sleep(0.1)
        raise ServerStartError(f"transformers serve not healthy after {timeout:.0f}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


def start_peer(peer: str, model_dir: Path, args: argparse.Namespace, tmp: Path):
    """(server with .url/.wait/.stop, the model name clients send)."""
    if peer == "keepwarm":
        max_seqs = str(max(64, args.min_requests))
        server_args = ["--served-model-name", "bench", "--dtype", args.dtype, "--max-num-seqs", max_seqs]
        server = start_server(
            model_dir, tmp / "keepwarm.log", args=[*server_args, "--kv-cache-memory-gib", "1"]
        )
        return server, "bench"
    server = TransformersServer(model_dir, args.dtype, tmp / "transformers.log", args.transformers_env)
    return server, str(model_dir)


def run_peer(peer: str, model_dir: Path, args: argparse.Namespace, tmp: Path) -> dict:
    server, model = start_peer(peer, model_dir, args, tmp)
    try:
        ready_s = server.wait(timeout=300)
        warm = [Request(0.0, "warm up " * 16, 8), Request(0.0, "warm up", 8)]
        asyncio.run(run_rate(server.url, model, peer, warm, 600))
        levels = []
        for rate in args.rates:
            requests = workload(rate, args)
            wall = 3 * requests[-1].at_s + 60
            outcomes = asyncio.run(run_rate(server.url, model, peer, requests, wall))
            levels.append(summarise(rate, requests, outcomes, args.slo_ttft_p99))
            print(f"# {peer} {json.dumps(levels[-1])}", file=sys.stderr, flush=True)
            if not levels[-1]["sustained"]:
                break
    finally:
        server.stop()
    return {"ready_s": round(ready_s, 2), "levels": levels}


def best_levels(runs: list[dict]) -> dict[float, dict]:
    """Per rate, the level with the lowest TTFT p99 (unfinished requests count as worst) over rounds."""
    best: dict[float, dict] = {}
    for run in runs:
        for level in run["levels"]:
            key = (level["completed"] < level["requests"], level["ttft_p99_s"])
            current = best.get(level["offered_rate"])
            if current is None or key < (current["completed"] < current["requests"], current["ttft_p99_s"]):
                best[level["offered_rate"]] = level
    return best


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = (args.model_dir or REPO / "out" / "bench" / f"llama-{args.params}").resolve()
    if not (model_dir / "config.json").exists():
        command = [
            sys.executable,
            "-m",
            "keepwarm_runtime.cli",
            "make-model",
            str(model_dir),
            "--params",
            args.params,
        ]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    report: dict = {
        "benchmark": "serve",
        "model": {"arch": "llama", "params": args.params, "dtype": args.dtype, "dir": str(model_dir)},
        "load": {
            "rates": args.rates,
            "duration_s": args.duration,
            "min_requests": args.min_requests,
            "prompt_words": [8, args.max_prompt_words],
            "output_tokens": [8, args.max_output_len],
            "arrivals": "poisson",
            "seed": args.seed,
        },
        "slo_ttft_p99_s": args.slo_ttft_p99,
        "transformers_env": args.transformers_env,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "device": "cpu"},
        "rounds": [],
    }
    with tempfile.TemporaryDirectory(prefix="keepwarm-bench-serve-") as tmp:
        for r in range(args.rounds):
            order = args.peers if r % 2 == 0 else args.peers[::-1]
            round_ = {"order": order, "load_average_1m_before": round(os.getloadavg()[0], 2)}
            for peer in order:
                round_[peer] = run_peer(peer, model_dir, args, Path(tmp))
            round_["load_average_1m_after"] = round(os.getloadavg()[0], 2)
            report["rounds"].append(round_)
    summary = {}
    for peer in args.peers:
        best = best_levels([round_[peer] for round_ in report["rounds"]])
        sustained = [rate for rate, level in best.items() if level["sustained"]]
        summary[peer] = {
            "sustained_rate": max(sustained, default=0.0),
            "levels": [best[r] for r in sorted(best)],
        }
    if len(args.peers) == 2 and summary["transformers"]["sustained_rate"] > 0:
        summary["sustained_rate_ratio"] = round(
            summary["keepwarm"]["sustained_rate"] / summary["transformers"]["sustained_rate"], 2
        )
    report["summary"] = summary
    publish(report, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
