"""One real `keepwarm serve` process for the whole server suite, started against a hung cache daemon.

The cache socket accepts connections but never answers, so the engine spends the client's attach
timeout (5 s) loading: long enough to observe /health 200 with /ready and inference 503, and the
weights then come from disk by fallback, as they would on a node whose daemon is wedged.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from keepwarm_runtime.server.launcher import ServerProcess, http_get, start_server

MAX_MODEL_LEN = 512


@dataclass
class Served:
    proc: ServerProcess
    model: str  # served model name
    early: dict  # responses seen while the weights were loading
    max_model_len: int = MAX_MODEL_LEN


@pytest.fixture(scope="session")
def hung_cache_dir(tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp("hung-cache")
    directory.chmod(0o700)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(directory / "host.sock"))
    listener.listen(16)  # never accepted: clients connect via the backlog and then time out
    yield directory
    listener.close()


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _long_poll_until_ready(url: str) -> list[tuple[int, float]]:
    """(status, seconds) of each /ready?wait=1000 request, as a startup probe retries them."""
    attempts: list[tuple[int, float]] = []
    while not attempts or (attempts[-1][0] != 200 and len(attempts) < 10):
        started = time.monotonic()
        status, _ = http_get(url + "/ready?wait=1000", 120.0)
        attempts.append((status, time.monotonic() - started))
    return attempts


@pytest.fixture(scope="session")
def served(tiny_llama: Path, hung_cache_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("server-log") / "serve.log"
    args = ["--served-model-name", "tiny", "--cache-socket-dir", str(hung_cache_dir)]
    args += ["--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "512", "--max-num-seqs", "32"]
    proc = start_server(tiny_llama, log, args=args)
    pool = ThreadPoolExecutor(1)
    try:
        proc.wait("/health", timeout=240)
        # A startup probe's long polls, sent while loading: answered once the weights are in.
        long_poll = pool.submit(_long_poll_until_ready, proc.url)
        early = {
            "ready": http_get(proc.url + "/ready"),
            "chat": _post(
                proc.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}
            ),
            "health": http_get(proc.url + "/health"),
        }
        proc.wait("/ready", timeout=240)
        early["ready_long_poll"] = long_poll.result(timeout=120)
        yield Served(proc, "tiny", early)
    finally:
        pool.shutdown(wait=False)
        code = proc.stop()
        assert code is not None


API_KEY = "s3cret-key"  # the key of the `served_secure` server


@pytest.fixture(scope="session")
def served_secure(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    """A second server: API key (from KEEPWARM_API_KEY), the hermes tool-call parser, trusted request
    chat templates, room for only 4 sequences at a time, and one intra-op thread (KEEPWARM_THREADS)."""
    log = tmp_path_factory.mktemp("server-secure-log") / "serve.log"
    args = ["--served-model-name", "tiny", "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "256"]
    args += ["--max-num-seqs", "4", "--tool-call-parser", "hermes", "--trust-request-chat-template"]
    env = {"KEEPWARM_API_KEY": API_KEY, "KEEPWARM_THREADS": "1"}  # --threads from the environment
    proc = start_server(tiny_llama, log, args=args, env=env)
    try:
        proc.wait("/ready", timeout=240)
        yield Served(proc, "tiny", {})
    finally:
        code = proc.stop()
        assert code is not None


def engine_is_idle(proc: ServerProcess, headers: dict[str, str] | None = None) -> dict:
    """The engine's counters once nothing is in flight (polls briefly: aborts are asynchronous)."""
    import time

    import httpx

    deadline = time.monotonic() + 10
    while True:
        stats = httpx.get(proc.url + "/debug/stats", headers=headers, timeout=5).raise_for_status().json()
        if (stats["num_running"], stats["num_waiting"], stats["kv_cache_usage"]) == (0, 0, 0) or (
            time.monotonic() > deadline
        ):
            return stats
        time.sleep(0.1)
