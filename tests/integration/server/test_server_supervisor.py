"""The supervising parent of a real `keepwarm serve`: a killed or hung worker is replaced, clients wait in
the backlog meanwhile (never refused), a crash loop backs off and fails the parent's /health, SIGTERM
drains, and nothing leaks (processes, descriptors)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import httpx2
import openai
import pytest

from keepwarm_runtime.server.launcher import ServerProcess, start_server

ARGS = [
    "--served-model-name",
    "tiny",
    "--max-model-len",
    "256",
    "--num-kv-blocks",
    "128",
    "--max-num-seqs",
    "8",
]


USAGE = {"include_usage": True}  # a stream's tokens are counted by its usage, not its chunks
NO_EOS = {"ignore_eos": True}


def _start(model: Path, log: Path, *extra: str) -> ServerProcess:
    proc = start_server(model, log, args=[*ARGS, *extra])
    proc.wait("/ready", timeout=240)
    return proc


@pytest.fixture(scope="module")
def supervised(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = _start(
        tiny_llama, tmp_path_factory.mktemp("supervised") / "serve.log", "--worker-health-timeout", "3"
    )
    try:
        yield proc
    finally:
        assert proc.stop() == 0, proc.log_tail()


def _client(proc: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=proc.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _complete(proc: ServerProcess) -> str:
    return _client(proc).completions.create(model="tiny", prompt="hello", max_tokens=4).choices[0].text


def _restarts(proc: ServerProcess) -> dict[str, float]:
    samples = proc.metrics()
    return {
        m[1]: v
        for k, v in samples.items()
        if (m := re.match(r'keepwarm_worker_restarts_total\{cause="(\w+)"\}', k))
    }


def _new_worker(proc: ServerProcess, old: int, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _, body = proc.parent_health()
        if body.get("worker_pid") not in (None, old):
            return int(body["worker_pid"])
        time.sleep(0.05)
    raise AssertionError(f"no new worker after {timeout}s\n{proc.log_tail()}")


class _Connector(threading.Thread):
    """Opens TCP connections to the server's port in a loop and counts the refused ones."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        parts = urlsplit(url)
        self.address = (parts.hostname, parts.port)
        self.stop, self.refused, self.connected = threading.Event(), 0, 0

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                socket.create_connection(self.address, timeout=5).close()
                self.connected += 1
            except ConnectionRefusedError:
                self.refused += 1
            except OSError:
                pass
            time.sleep(0.01)


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_the_parent_forks_with_one_thread_and_names_its_worker(supervised):
    pid = supervised.worker_pid()
    assert pid != supervised.proc.pid
    assert os.getpgid(pid) == supervised.proc.pid  # the launcher's process group holds both
    assert "forking the worker although" not in supervised.log_text()  # one thread, no CUDA
    assert "preloaded the serving path" in supervised.log_text()
    status, body = supervised.parent_health()
    assert status == 200 and body["status"] == "ok"


def test_a_worker_killed_mid_stream_is_replaced_without_refusing_anyone(supervised):
    before = _restarts(supervised)["crash"]
    parent_fds = _fds(supervised.proc.pid)
    old = supervised.worker_pid()
    connector = _Connector(supervised.url)
    stream = _client(supervised).completions.create(
        model="tiny", prompt="count", max_tokens=200, stream=True, extra_body={"ignore_eos": True}
    )
    # The client's transport is httpx2 in recent openai releases; some wrap its errors in APIError.
    with pytest.raises((openai.APIError, httpx.HTTPError, httpx2.HTTPError)):
        for i, _ in enumerate(stream):
            if i == 1:
                connector.start()
                os.kill(old, signal.SIGKILL)
    # At once, with no retry: the connection waits in the parent's backlog until the new worker serves.
    assert _complete(supervised)
    connector.stop.set()
    connector.join(10)
    assert connector.refused == 0 and connector.connected > 0
    new = _new_worker(supervised, old)
    with pytest.raises(ProcessLookupError):
        os.kill(old, 0)  # reaped, not a zombie
    assert _restarts(supervised)["crash"] == before + 1  # the new worker inherited the parent's counts
    assert _fds(supervised.proc.pid) == parent_fds  # nothing leaked per restart
    assert "killed by SIGKILL" in supervised.log_text()
    assert new != old


def test_a_hung_worker_is_killed_and_replaced(supervised):
    before = _restarts(supervised)["hang"]
    old = supervised.worker_pid()
    os.kill(old, signal.SIGSTOP)  # alive but answering nothing: only /health can tell
    try:
        _new_worker(supervised, old)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(old, signal.SIGCONT)
    with pytest.raises(ProcessLookupError):
        os.kill(old, 0)
    assert _complete(supervised)
    assert _restarts(supervised)["hang"] == before + 1
    assert "/health went unanswered" in supervised.log_text()


def test_a_worker_whose_load_never_ends_is_restarted_after_the_load_timeout(tiny_llama, tmp_path):
    """A worker that never gets to serve (here: stuck from its fork, by a hook the server's interpreter
    loads at start, as a load stuck on a hung network mount would be) is a hang once
    --worker-load-timeout has passed: the parent kills it, counts it, and fails its /health when
    restarts keep failing, so the liveness probe acts."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(
        "import os, time\nos.register_at_fork(after_in_child=lambda: time.sleep(3600))\n"
    )
    proc = start_server(
        tiny_llama, tmp_path / "serve.log",
        args=[*ARGS, "--worker-load-timeout", "3", "--worker-health-timeout", "1",
              "--max-failed-restarts", "1"],
        env={"PYTHONPATH": os.pathsep.join(filter(None, [str(hooks), os.environ.get("PYTHONPATH")]))},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        status, body = 0, {}
        while time.monotonic() < deadline and status != 503 and proc.proc.poll() is None:
            time.sleep(0.2)
            status, body = proc.parent_health()
        assert status == 503 and body["restarts"]["hang"] >= 1, proc.log_tail()
        assert re.search(r"the worker did not serve within [\d.]+s of its fork", proc.log_text())
    finally:
        proc.stop()


def test_a_crash_loop_backs_off_and_fails_the_parents_health(tiny_llama, tmp_path):
    proc = _start(tiny_llama, tmp_path / "serve.log", "--max-failed-restarts", "3")
    try:
        pid = proc.worker_pid()
        for _ in range(3):
            os.kill(pid, signal.SIGKILL)
            pid = _new_worker(proc, pid)
        status, body = proc.parent_health()
        assert status == 503 and body["status"] == "failing" and body["restarts_in_a_row"] == 3
        delays = [float(d) for d in re.findall(r"restart \d in a row, in ([\d.]+)s", proc.log_text())]
        assert delays == [0.0, 0.5, 1.0]
        assert proc.proc.poll() is None  # still trying: Kubernetes' liveness probe decides
    finally:
        assert proc.stop() == 0


def test_sigterm_drains_the_request_in_flight_then_stops(tiny_llama, tmp_path):
    proc = _start(tiny_llama, tmp_path / "serve.log")
    worker = proc.worker_pid()
    stream = _client(proc).completions.create(
        model="tiny", prompt="go", max_tokens=64, stream=True, stream_options=USAGE, extra_body=NO_EOS
    )
    chunks = []
    for chunk in stream:
        if not chunks:
            os.kill(proc.proc.pid, signal.SIGTERM)  # the parent only, as Kubernetes sends it
        chunks.append(chunk)
    # every token (a chunk may carry several), a normal end
    assert chunks[-1].usage.completion_tokens == 64 and chunks[-2].choices[0].finish_reason == "length"
    assert proc.proc.wait(30) == 0
    with pytest.raises(ProcessLookupError):
        os.kill(worker, 0)
    assert "stopping worker" in proc.log_text()


def test_without_the_parent_the_server_is_one_process(tiny_llama, tmp_path):
    proc = _start(tiny_llama, tmp_path / "serve.log", "--no-supervise")
    try:
        assert proc.worker_pid() == proc.proc.pid and proc.parent_url is None
        assert _complete(proc)
        assert "supervising" not in proc.log_text()
    finally:
        assert proc.stop() is not None  # uvicorn ends a lone server by re-raising the SIGTERM


def test_after_sigterm_new_connections_are_refused_while_the_stream_in_flight_finishes(tiny_llama, tmp_path):
    """Once the pod is told to stop (after its preStop), a stray new connection is refused at once, so a
    client retries another endpoint, instead of waiting in a backlog nobody will accept from; the
    stream already running still gets every token."""
    proc = _start(tiny_llama, tmp_path / "serve.log")
    host, port = urlsplit(proc.url).hostname, urlsplit(proc.url).port
    stream = _client(proc).completions.create(
        model="tiny", prompt="go", max_tokens=200, stream=True, stream_options=USAGE, extra_body=NO_EOS
    )
    chunks, attempts = [], []
    for chunk in stream:
        if not chunks:
            os.kill(proc.proc.pid, signal.SIGTERM)
        elif "refused" not in attempts:
            try:
                socket.create_connection((host, port), timeout=2).close()
                attempts.append("accepted")
            except ConnectionRefusedError:
                attempts.append("refused")
            except OSError as exc:
                attempts.append(type(exc).__name__)
        chunks.append(chunk)
    assert chunks[-1].usage.completion_tokens == 200 and chunks[-2].choices[0].finish_reason == "length"
    assert "refused" in attempts, (attempts, proc.log_text()[-2000:])
    assert proc.proc.wait(60) == 0
