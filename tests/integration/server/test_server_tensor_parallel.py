"""`keepwarm serve --tensor-parallel-size 2`: a group of ranks forked by the supervising parent.

The group answers the openai client as one rank does (greedy text equal to one process's); a rank
killed mid-request fails the requests in flight with an error, the parent restarts the whole group
and the server serves again; settings that cannot run a group are refused before any fork, by name.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import httpx2
import openai
import pytest

from keepwarm_runtime.server.launcher import ServerProcess, start_server
from tests.integration.server.test_server_supervisor import ARGS  # the supervised server's settings

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def group(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("tp-serve") / "serve.log"
    proc = start_server(tiny_llama, log, args=[*ARGS, "--tensor-parallel-size", "2"])
    try:
        proc.wait("/ready", timeout=300)
        yield proc
    finally:
        assert proc.stop() == 0, proc.log_tail()


def _client(proc: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=proc.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _complete(proc: ServerProcess, prompt: str = "hello", tokens: int = 8) -> str:
    response = _client(proc).completions.create(model="tiny", prompt=prompt, max_tokens=tokens, temperature=0)
    return response.choices[0].text


def _ranks(proc: ServerProcess) -> tuple[int, dict[str, int]]:
    _, body = proc.parent_health()
    return body.get("worker_pid"), body.get("rank_pids") or {}


def _crashes(proc: ServerProcess) -> float:
    samples = proc.metrics()
    return next((v for k, v in samples.items() if k == 'keepwarm_worker_restarts_total{cause="crash"}'), 0.0)


@pytest.mark.extended
def test_two_ranks_answer_as_one_process_does(group, tiny_llama) -> None:
    from keepwarm_runtime import LLM, SamplingParams

    worker, ranks = _ranks(group)
    assert set(ranks) == {"1"} and worker not in ranks.values()
    assert os.getpgid(ranks["1"]) == group.proc.pid  # forked by the parent, in its process group
    assert "forking the worker although" not in group.log_text()  # one thread, no CUDA, in the parent
    assert "joined the tensor-parallel group as rank 1 of 2 (gloo)" in group.log_text()
    one = LLM(tiny_llama, dtype="float32", max_model_len=256, num_kv_blocks=128)
    prompt = "the weights stay warm"
    want = one.generate(prompt, SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    assert _complete(group, prompt) == want


@pytest.mark.extended
def test_a_rank_killed_mid_request_fails_it_and_the_group_restarts(group) -> None:
    before = _crashes(group)
    worker, ranks = _ranks(group)
    stream = _client(group).completions.create(
        model="tiny", prompt="count", max_tokens=200, stream=True, extra_body={"ignore_eos": True}
    )
    with pytest.raises((openai.APIError, httpx.HTTPError, httpx2.HTTPError)):
        for i, _ in enumerate(stream):
            if i == 1:
                os.kill(ranks["1"], signal.SIGKILL)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        new_worker, new_ranks = _ranks(group)
        if new_worker not in (None, worker) and new_ranks.get("1") not in (None, ranks["1"]):
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the group was not restarted\n{group.log_tail()}")
    for pid in (worker, ranks["1"]):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # the whole old group is gone and reaped
    group.wait("/ready", timeout=240)
    assert _complete(group)
    assert _crashes(group) == before + 1
    assert re.search(r"the tensor-parallel rank 1 killed by SIGKILL", group.log_text())


def refused(model: Path, *args: str) -> str:
    """`keepwarm serve MODEL ARGS`'s stderr, which must end with 2 (refused before serving)."""
    result = subprocess.run(
        [sys.executable, "-m", "keepwarm_runtime.cli", "serve", str(model), "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    return result.stderr


def test_settings_that_cannot_run_a_group_are_refused_by_name(tiny_llama) -> None:
    assert "2 key/value heads (num_key_value_heads) do not divide over 4" in refused(
        tiny_llama, "--tensor-parallel-size", "4"
    )
    assert "needs the supervising parent" in refused(
        tiny_llama, "--tensor-parallel-size", "2", "--no-supervise"
    )
    assert "takes cuda:0, cuda:1" in refused(tiny_llama, "--tensor-parallel-size", "2", "--device", "cuda:1")
