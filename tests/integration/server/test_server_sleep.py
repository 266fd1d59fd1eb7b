"""Sleep mode through a real `keepwarm serve` and the official openai client: sleep frees the engine,
requests get a clear 503 (or wake it, by flag), a busy engine refuses with 409 or drains (drain=true:
running requests finish, new ones get the 503 meanwhile), and after waking the same greedy request
gives the same text (the weights came back intact, from the cache or the disk)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from keepwarm_runtime.cache.launcher import DaemonProcess
from keepwarm_runtime.server.launcher import ServerProcess, start_server

ARGS = [
    "--served-model-name",
    "tiny",
    "--max-model-len",
    "256",
    "--num-kv-blocks",
    "64",
    "--enable-sleep-mode",
]
ARGS += ["--dtype", "float32"]


USAGE = {"include_usage": True}  # a stream's tokens are counted by its usage, not its chunks
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def cached(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server whose weights come from a running cache daemon (no fallback), asleep only on request."""
    root = tmp_path_factory.mktemp("sleep-cache")
    daemon = DaemonProcess(root / "wc", [tiny_llama], "--dtype", "float32", tier="host").wait_ready(
        timeout_s=240
    )
    args = [*ARGS, "--cache-socket-dir", str(root / "wc"), "--no-cache-fallback"]
    proc = start_server(tiny_llama, root / "serve.log", args=args)
    try:
        proc.wait("/ready", timeout=240)
        yield proc
    finally:
        proc.stop()
        daemon.terminate(30)


@pytest.fixture(scope="module")
def waking(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server loading from disk that a request wakes (--wake-on-request)."""
    root = tmp_path_factory.mktemp("sleep-disk")
    proc = start_server(tiny_llama, root / "serve.log", args=[*ARGS, "--wake-on-request"])
    try:
        proc.wait("/ready", timeout=240)
        yield proc
    finally:
        proc.stop()


def _client(proc: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=proc.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _greedy(proc: ServerProcess) -> str:
    messages = [{"role": "user", "content": "tell me about the weights"}]
    reply = _client(proc).chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0
    )
    return reply.choices[0].message.content


def _sleep_level(proc: ServerProcess) -> float:
    return proc.metrics()["keepwarm_sleep_level"]


def _tokens_to_the_end(chunks) -> int:
    """Read a stream (asked with usage) to its end: the tokens it generated, by its usage chunk (a
    chunk may carry several tokens, when the stream fell behind the engine)."""
    *_, usage = chunks
    return usage.usage.completion_tokens


def _is_sleeping(proc: ServerProcess) -> bool:
    return httpx.get(proc.url + "/is_sleeping", timeout=30).raise_for_status().json()["is_sleeping"]


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_answers_503_and_wake_restores_the_same_weights_from_the_cache(cached, level):
    before = _greedy(cached)
    assert httpx.post(cached.url + f"/sleep?level={level}", timeout=60).status_code == 200
    assert _is_sleeping(cached) and _sleep_level(cached) == level
    with pytest.raises(openai.InternalServerError) as info:
        _greedy(cached)
    assert info.value.status_code == 503 and info.value.body["code"] == "model_sleeping"
    assert httpx.get(cached.url + "/ready", timeout=30).status_code == 503  # routers route around it
    health = httpx.get(cached.url + "/health", timeout=30)
    assert health.status_code == 200 and health.json()["engine"] == "sleeping"
    assert httpx.post(cached.url + "/wake_up", timeout=60).status_code == 200
    assert not _is_sleeping(cached) and _sleep_level(cached) == 0
    assert _greedy(cached) == before
    assert (
        "woke: weights from cache" in cached.log_text()
    )  # level 1 let go of them too: the daemon keeps them


def test_sleep_while_a_request_runs_is_a_409(cached):
    stream = _client(cached).completions.create(
        model="tiny", prompt="go", max_tokens=200, stream=True, stream_options=USAGE, extra_body=NO_EOS
    )
    chunks = iter(stream)
    next(chunks)
    refused = httpx.post(cached.url + "/sleep?level=1", timeout=60)
    assert refused.status_code == 409, refused.text
    assert "requests are running" in refused.json()["error"]["message"]
    assert _tokens_to_the_end(chunks) == 200  # the request carried on to its end
    assert not _is_sleeping(cached)


def test_a_drained_sleep_lets_running_requests_finish_and_refuses_new_ones(cached):
    """drain=true: the running stream reaches its end, a request sent meanwhile is a 503
    model_sleeping, /ready is 503, and the engine sleeps once the stream is done."""
    stream = _client(cached).completions.create(
        model="tiny", prompt="go", max_tokens=200, stream=True, stream_options=USAGE, extra_body=NO_EOS
    )
    chunks = iter(stream)
    next(chunks)
    with ThreadPoolExecutor(1) as pool:
        sleeping = pool.submit(httpx.post, cached.url + "/sleep?level=1&drain=true", timeout=120)
        while httpx.get(cached.url + "/ready", timeout=30).status_code == 200:
            assert not sleeping.done(), sleeping.result().text  # it must wait for the stream
        with pytest.raises(openai.InternalServerError) as info:
            _greedy(cached)
        assert info.value.status_code == 503 and info.value.body["code"] == "model_sleeping"
        assert not _is_sleeping(cached)  # the stream still runs
        assert _tokens_to_the_end(chunks) == 200  # and carries on to its end
        assert sleeping.result().status_code == 200
    assert _is_sleeping(cached) and _sleep_level(cached) == 1
    assert httpx.post(cached.url + "/wake_up", timeout=60).status_code == 200
    assert _greedy(cached)


def test_bad_drain_values_are_refused_by_name(cached):
    response = httpx.post(cached.url + "/sleep?level=1&drain=maybe", timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "drain"
    assert not _is_sleeping(cached)


def test_bad_levels_are_refused_by_name(cached):
    response = httpx.post(cached.url + "/sleep?level=3", timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "level"


def test_a_request_wakes_a_server_asleep_at_level_2_and_reloads_from_disk(waking):
    before = _greedy(waking)
    assert httpx.post(waking.url + "/sleep?level=2", timeout=60).status_code == 200
    assert _is_sleeping(waking)
    assert _greedy(waking) == before  # --wake-on-request: woken, weights read again from disk
    assert not _is_sleeping(waking)
    assert re.search(r"woke: weights from disk", waking.log_text())


def test_sleep_routes_exist_only_with_sleep_mode(served):
    assert httpx.post(served.proc.url + "/sleep?level=1", timeout=30).status_code == 404
    assert httpx.get(served.proc.url + "/is_sleeping", timeout=30).status_code == 404


def test_a_wake_without_the_cache_fails_by_name_and_stays_asleep_until_it_can(tiny_llama, tmp_path):
    daemon = DaemonProcess(tmp_path / "wc", [tiny_llama], "--dtype", "float32", tier="host").wait_ready(
        timeout_s=240
    )
    args = [*ARGS, "--cache-socket-dir", str(tmp_path / "wc"), "--no-cache-fallback"]
    proc = start_server(tiny_llama, tmp_path / "serve.log", args=args)
    try:
        proc.wait("/ready", timeout=240)
        before = _greedy(proc)
        assert httpx.post(proc.url + "/sleep?level=1", timeout=60).status_code == 200
        daemon.terminate(30)  # the node cache goes away while the server sleeps
        failed = httpx.post(proc.url + "/wake_up", timeout=120)
        assert failed.status_code == 503 and failed.json()["error"]["code"] == "wake_failed", failed.text
        assert _is_sleeping(proc)
        daemon = DaemonProcess(tmp_path / "wc", [tiny_llama], "--dtype", "float32", tier="host")
        daemon.wait_ready(timeout_s=240)
        assert httpx.post(proc.url + "/wake_up", timeout=120).status_code == 200
        assert _greedy(proc) == before
    finally:
        proc.stop()
        daemon.terminate(30)
