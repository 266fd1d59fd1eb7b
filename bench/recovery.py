"""Recovery benchmark: how fast a warm `keepwarm serve` comes back, side by side in one run.

All on one generated Llama checkpoint (the demo's 500M by default) served from a running node cache
daemon (host tier, weights already resident; ``--no-cache-fallback``, so nothing is read from disk):

* ``fresh_ready_s``: a new ``keepwarm serve --no-supervise`` process, spawn to its first 200 from
  /ready (today's container restart); ``fresh_after_imports_s`` is its own start-to-ready minus the
  ``imports`` phase (config, model_meta, weights, tokenizer, attention, kv_alloc, warmup);
* ``supervised_ready_s``: the same with the supervising parent (the default), spawn to /ready;
  ``supervised_worker_ready_s`` is the worker's own fork-to-ready;
* ``crash_to_first_token_s``: SIGKILL of the serving worker, then at once a streamed completion
  (it waits in the parent's listen backlog), until its first token arrives; ``crash_worker_ready_s``
  is the new worker's fork-to-ready and ``crash_phases_s`` its phases;
* ``wake_to_first_token_s``: from ``POST /wake_up`` on a server asleep at level 1 (its weights let go,
  kept by the daemon; KV cache freed) to the first token of a streamed completion; ``wake_s`` is the
  wake call alone; ``wake_level2_to_first_token_s`` the same from level 2.

Crashes and wakes run ``--repeats`` times; the best and every run are reported. Crashes are spaced
by the supervisor's ``STABLE_S``, so each is a first crash (crashes closer together are a crash loop,
which backs off on purpose). Each figure is wall
time seen by a client on loopback. Run: ``keepwarm bench recovery --json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

from keepwarm_api.settings import SettingError, add_arguments, resolve
from keepwarm_runtime.bench_cli import RecoverySettings
from keepwarm_runtime.cache.backends.host import page_facts
from keepwarm_runtime.cache.launcher import DaemonProcess
from keepwarm_runtime.server.launcher import ServerProcess, start_server
from keepwarm_runtime.server.supervisor import STABLE_S

CHECKPOINT_DTYPE = "bfloat16"
READY_METRIC = "keepwarm_process_start_to_ready_seconds"
PHASE_METRIC = "keepwarm_startup_phase_seconds"


def checkpoint(params: str, root: Path) -> Path:
    """A Llama checkpoint of ``params`` parameters in bfloat16, generated once and reused."""
    path = root / f"llama-{params}-{CHECKPOINT_DTYPE}"
    if (path / "config.json").exists():
        return path
    from keepwarm_runtime.modelgen import make_model

    tmp = path.with_name(path.name + ".tmp")
    make_model(tmp, arch="llama", params=params, dtype=CHECKPOINT_DTYPE)
    tmp.rename(path)
    return path


def phases(metrics: dict[str, float]) -> dict[str, float]:
    """The server's start-up phases (engine/startup.py) out of its /metrics."""
    return {
        key.split('phase="', 1)[1].rstrip('"}'): round(value, 3)
        for key, value in metrics.items()
        if key.startswith(PHASE_METRIC + "{")
    }


def first_token_at(url: str) -> float:
    """perf_counter() when the first token of a streamed one-token completion arrives."""
    body = {"model": "demo", "prompt": "hello", "max_tokens": 1, "stream": True, "temperature": 0}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter()
    raise RuntimeError("the stream ended without a token")


def _dead(pid: int) -> bool:
    """Gone or a zombie: a killed worker can accept nothing more."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def crash_once(server: ServerProcess) -> dict:
    old = server.worker_pid()
    started = time.perf_counter()
    os.kill(old, signal.SIGKILL)
    while not _dead(old):
        time.sleep(0.0005)
    token = first_token_at(server.url) - started
    metrics = server.metrics()  # the new worker's
    return {
        "crash_to_first_token_s": round(token, 3),
        "worker_ready_s": round(metrics[READY_METRIC], 3),
        "phases_s": phases(metrics),
    }


def wake_once(server: ServerProcess, level: int) -> dict:
    httpx.post(server.url + f"/sleep?level={level}", timeout=120).raise_for_status()
    started = time.perf_counter()
    httpx.post(server.url + "/wake_up", timeout=300).raise_for_status()
    woke = time.perf_counter() - started
    token = first_token_at(server.url) - started
    return {"wake_to_first_token_s": round(token, 3), "wake_s": round(woke, 3)}


def _start(model: Path, log: Path, args: list[str]) -> tuple[ServerProcess, float]:
    server = start_server(model, log, args=args)
    try:
        return server, server.wait("/ready", timeout=900)
    except BaseException:
        server.stop()
        raise


def _best(runs: list[dict], key: str) -> float:
    return min(r[key] for r in runs)


def run(settings: RecoverySettings) -> dict:
    root = Path(settings.dir) if settings.dir else Path.home() / ".cache" / "keepwarm" / "bench"
    model = checkpoint(settings.params, root)
    out: dict = {
        "params": settings.params,
        "serving_dtype": settings.serving_dtype,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "loadavg_1m_start": round(os.getloadavg()[0], 2),
        **page_facts(),  # the client's map of the arena, hence every attach and wake, depends on them
    }
    with tempfile.TemporaryDirectory(prefix="keepwarm-recovery-") as tmp:
        socket_dir = Path(tmp) / "wc"
        daemon = DaemonProcess(socket_dir, [model], "--dtype", settings.serving_dtype, tier="host")
        daemon.wait_ready(timeout_s=1800)
        args = ["--served-model-name", "demo", "--dtype", settings.serving_dtype]
        args += ["--cache-socket-dir", str(socket_dir), "--no-cache-fallback"]
        if settings.threads > 0:
            args += ["--threads", str(settings.threads)]
        try:
            fresh, fresh_wall = _start(model, Path(tmp) / "fresh.log", [*args, "--no-supervise"])
            try:
                metrics = fresh.metrics()
                fresh_phases = phases(metrics)
                out["fresh_ready_s"] = round(fresh_wall, 3)
                out["fresh_process_ready_s"] = round(metrics[READY_METRIC], 3)
                out["fresh_after_imports_s"] = round(
                    metrics[READY_METRIC] - fresh_phases.get("imports", 0.0), 3
                )
                out["fresh_phases_s"] = fresh_phases
            finally:
                fresh.stop()
            server, supervised_wall = _start(
                model, Path(tmp) / "supervised.log", [*args, "--enable-sleep-mode"]
            )
            try:
                out["supervised_ready_s"] = round(supervised_wall, 3)
                out["supervised_worker_ready_s"] = round(server.metrics()[READY_METRIC], 3)
                first_token_at(server.url)
                crashes = []
                for i in range(settings.repeats):
                    if i:  # a crash within STABLE_S of the last is a crash loop: it would back off
                        time.sleep(STABLE_S + 2)
                    crashes.append(crash_once(server))
                best = min(crashes, key=lambda r: r["crash_to_first_token_s"])
                out["crash_to_first_token_s"] = best["crash_to_first_token_s"]
                out["crash_worker_ready_s"] = best["worker_ready_s"]
                out["crash_phases_s"] = best["phases_s"]
                out["crash_runs_s"] = [r["crash_to_first_token_s"] for r in crashes]
                wakes = [wake_once(server, 1) for _ in range(settings.repeats)]
                out["wake_to_first_token_s"] = _best(wakes, "wake_to_first_token_s")
                out["wake_s"] = _best(wakes, "wake_s")
                out["wake_runs_s"] = [r["wake_to_first_token_s"] for r in wakes]
                deep = [wake_once(server, 2) for _ in range(settings.repeats)]
                out["wake_level2_to_first_token_s"] = _best(deep, "wake_to_first_token_s")
                out["restarts"] = {
                    k.split('"')[1]: v
                    for k, v in server.metrics().items()
                    if k.startswith("keepwarm_worker_restarts_total")
                }
            finally:
                server.stop()
        finally:
            daemon.terminate(60)
    out["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.recovery [flags]`; `keepwarm bench recovery` calls ``report`` with its settings."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p, RecoverySettings)
    try:
        settings = resolve(RecoverySettings, p.parse_args(sys.argv[1:] if argv is None else argv))
    except SettingError as exc:
        p.error(str(exc))
    return report(settings)


def report(settings: RecoverySettings) -> int:
    result = run(settings)
    print(json.dumps(result) if settings.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
