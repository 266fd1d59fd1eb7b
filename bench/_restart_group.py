"""`keepwarm bench restart --tensor-parallel N`: a tensor-parallel group's restart, from disk and the cache.

bench/restart.py hands its settings here when --tensor-parallel is above 1 (a module, not a benchmark
of its own: `keepwarm bench` lists bench/restart.py).

Every run is a whole `keepwarm serve` start (the supervising parent imports, then forks the ranks) to a
200 from /ready, then one greedy request's first token; for one rank and for N ranks, each reading the
checkpoint from disk and attaching from a running daemon that holds what those ranks ask for (the
whole model; N shards, one arena each: `keepwarm cache serve --tensor-parallel-size N`). Per start:

- ``ready_s``: the server's own start to ready (rank 0's fork to ready; it waits for every rank, since
  the group meets, compares checkpoints and sizes the KV cache together), and its phases;
- ``ranks``: each rank's source, weights phase and attach time (every rank logs its own line:
  engine/loader.py), so a rank that fell back to disk shows;
- ``first_token_s``: the first request's latency once ready; ``ttft_s`` = ready + that.

Goals (issue 36), checked and reported under ``goals``: every rank's weights phase from the cache
<= 0.1 s, and the group's warm start (cache) no slower than one rank's warm start + 0.5 s.
``throughput``: tokens/s of one fixed batch (8 requests x 32 tokens, greedy, ignore_eos) on each warm
server, N ranks against one: a measure, not a goal (on a small CPU the ranks share its cores).
Run: ``keepwarm bench restart --tensor-parallel 2 --size-gib 0.5 --json``.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.restart import checkpoint_for, serve_args, startup_report
from bench.step import machine
from keepwarm_runtime.bench_cli import RestartSettings
from keepwarm_runtime.cache.launcher import DaemonProcess
from keepwarm_runtime.server.launcher import ServerProcess, start_server

RANK_LINE = re.compile(r"rank (\d+) of (\d+): weights from (\w+) in ([\d.]+)s \(attach ([\d.]+)s\)")
GOAL_RANK_WEIGHTS_S = 0.1  # each rank's weights phase from the cache
GOAL_GROUP_OVER_ONE_S = 0.5  # the group's warm start over one rank's
BATCH, BATCH_TOKENS, PROMPT = 8, 32, list(range(10, 26))


def rank_lines(log: str) -> dict[int, dict]:
    """Each rank's weights line of one start (the last one per rank: a server log holds one start)."""
    ranks = {}
    for m in RANK_LINE.finditer(log):
        ranks[int(m[1])] = {"source": m[3], "weights_s": float(m[4]), "attach_s": float(m[5])}
    return ranks


def _post(url: str, body: dict, timeout: float = 600) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def _completion(server: ServerProcess, tokens: int) -> dict:
    body = {
        "model": server.get_json("/v1/models")["data"][0]["id"],
        "prompt": PROMPT,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    return _post(server.url + "/v1/completions", body)


def throughput(server: ServerProcess) -> dict:
    """Tokens/s of BATCH concurrent greedy requests of BATCH_TOKENS each."""
    started = time.perf_counter()
    with ThreadPoolExecutor(BATCH) as pool:
        replies = list(pool.map(lambda _: _completion(server, BATCH_TOKENS), range(BATCH)))
    seconds = time.perf_counter() - started
    tokens = sum(r["usage"]["completion_tokens"] for r in replies)
    return {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 2)}


def _start(
    settings: RestartSettings, model: Path, ranks: int, socket_dir: Path | None, log: Path, busy: bool
) -> dict:
    args = [*serve_args(settings, socket_dir), "--tensor-parallel-size", str(ranks)]
    server = start_server(model, log, args=args)
    try:
        wall = server.wait("/ready", timeout=900)
        started = time.perf_counter()
        text = _completion(server, 1)["choices"][0]["text"]
        first = time.perf_counter() - started
        report = startup_report(server.metrics())
        report |= {
            "wall_to_ready_s": round(wall, 3),
            "first_token_s": round(first, 3),
            "ttft_s": round(report["ready_s"] + first, 3),
            "first_text": text,
            "ranks": rank_lines(server.log_text())
            if ranks > 1
            else {0: {"source": report["weights_source"]}},
        }
        if busy:
            report["throughput"] = throughput(server)
        return report
    finally:
        server.stop()


def _best(settings, model, ranks, socket_dir, logs: Path, name: str, busy: bool = False) -> dict:
    """Best (by ready time) of --repeats starts; the last one also measures throughput when ``busy``."""
    runs = [
        _start(
            settings, model, ranks, socket_dir, logs / f"{name}-{i}.log", busy and i == settings.repeats - 1
        )
        for i in range(settings.repeats)
    ]
    best = min(runs, key=lambda r: r["ready_s"])
    if busy:
        best["throughput"] = runs[-1]["throughput"]
    return best | {"ready_s_runs": [r["ready_s"] for r in runs]}


def _daemon(root: Path, model: Path, settings: RestartSettings, ranks: int) -> DaemonProcess:
    extra = ["--dtype", settings.serving_dtype, "--tensor-parallel-size", str(ranks)]
    return DaemonProcess(root, [model], *extra, tier="host").wait_ready(timeout_s=900)


def run(settings: RestartSettings) -> dict:
    from keepwarm_runtime.weights.checkpoint import read_checkpoint

    if settings.device != "cpu":
        raise SystemExit("keepwarm bench restart --tensor-parallel: the CPU (host tier) only for now")
    root = Path(settings.dir) if settings.dir else Path.home() / ".cache" / "keepwarm" / "bench"
    model = checkpoint_for(settings.size_gib, root)
    group = settings.tensor_parallel
    out: dict = {
        "tensor_parallel": group,
        "size_bytes": sum(s.size for s in read_checkpoint(model)),
        "serving_dtype": settings.serving_dtype,
        "device": settings.device,
        "tier": "host",
        "repeats": settings.repeats,
        "machine": machine(),  # CPU flags and cores: what the figures depend on
        "loadavg_1m_start": round(os.getloadavg()[0], 2),
    }
    with tempfile.TemporaryDirectory(prefix="keepwarm-bench-tp-") as tmp:
        logs = Path(tmp) / "logs"
        for ranks in (1, group):
            daemon = _daemon(Path(tmp) / f"wc-{ranks}", model, settings, ranks)
            try:
                out[f"tp{ranks}"] = {
                    "disk": _best(settings, model, ranks, None, logs, f"disk-{ranks}"),
                    "cache": _best(
                        settings, model, ranks, daemon.socket_dir, logs, f"cache-{ranks}", busy=True
                    ),
                    "daemon_ready_s": round(daemon.ready_s, 3),
                }
            finally:
                daemon.terminate(60)
    one, many = out["tp1"]["cache"], out[f"tp{group}"]["cache"]
    rank_weights = [r["weights_s"] for r in many["ranks"].values()]
    out["goals"] = {
        "rank_weights_from_cache_s_max": max(rank_weights),
        "rank_weights_goal_s": GOAL_RANK_WEIGHTS_S,
        "rank_weights_met": max(rank_weights) <= GOAL_RANK_WEIGHTS_S
        and all(r["source"] == "cache" for r in many["ranks"].values()),
        "group_over_one_warm_s": round(many["ready_s"] - one["ready_s"], 3),
        "group_over_one_goal_s": GOAL_GROUP_OVER_ONE_S,
        "group_over_one_met": many["ready_s"] - one["ready_s"] <= GOAL_GROUP_OVER_ONE_S,
    }
    out["throughput_group_over_one"] = round(
        many["throughput"]["tokens_per_s"] / one["throughput"]["tokens_per_s"], 2
    )
    out["same_first_text"] = (
        len({out[f"tp{r}"][p]["first_text"] for r in (1, group) for p in ("disk", "cache")}) == 1
    )
    out["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    return out
