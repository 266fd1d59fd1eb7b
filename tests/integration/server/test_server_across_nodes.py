"""A tensor-parallel group over two nodes: `keepwarm serve --nnodes 2` twice, as a LeaderWorkerSet's two
pods run it (here two processes on this machine meeting over TCP on loopback).

Node rank 0 serves the API and answers the openai client as one process does (greedy text equal);
node rank 1 serves no API, only its parent's /health. A group over nodes is never restarted in place:
when a rank on the other node dies, its node's parent exits 1, and node 0's does at its next step (the
pod restarts, and the LeaderWorkerSet recreates the whole group). Shares that cannot run are refused
before any fork, by name.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest

from keepwarm_runtime.server.launcher import free_port, start_server
from tests.integration.server.test_server_supervisor import ARGS  # the supervised server's settings
from tests.integration.server.test_server_tensor_parallel import refused

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def nodes(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    logs = tmp_path_factory.mktemp("tp-nodes")
    group = [*ARGS, "--tensor-parallel-size", "2", "--nnodes", "2"]
    group += ["--master-addr", "localhost", "--master-port", str(free_port())]
    leader = start_server(tiny_llama, logs / "node0.log", args=[*group, "--node-rank", "0"])
    worker = start_server(tiny_llama, logs / "node1.log", args=[*group, "--node-rank", "1", "--headless"])
    try:
        leader.wait("/ready", timeout=300)
        yield SimpleNamespace(leader=leader, worker=worker)
    finally:
        for proc in (worker, leader):
            proc.stop()


def test_two_nodes_answer_as_one_process_does(nodes, tiny_llama) -> None:
    from keepwarm_runtime import LLM, SamplingParams

    assert "joined the tensor-parallel group as rank 1 of 2 (gloo)" in nodes.worker.log_text()
    assert "supervising ranks 1..1 of 2 (node 1 of 2, no API)" in nodes.worker.log_text()
    with pytest.raises(httpx.ConnectError):  # node 1 has no API port
        httpx.get(nodes.worker.url + "/health", timeout=5)
    status, body = nodes.worker.parent_health()
    assert status == 200 and body["worker_pid"] is not None  # its rank 1, forked by its parent
    one = LLM(tiny_llama, dtype="float32", max_model_len=256, num_kv_blocks=128)
    prompt = "the weights stay warm"
    want = one.generate(prompt, SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    client = openai.OpenAI(base_url=nodes.leader.url + "/v1", api_key="none", max_retries=0, timeout=120)
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    assert got.choices[0].text == want


def test_a_rank_lost_on_the_other_node_ends_the_group_for_a_restart_as_a_whole(nodes) -> None:
    _, body = nodes.worker.parent_health()
    os.kill(body["worker_pid"], signal.SIGKILL)  # rank 1, on node 1
    assert nodes.worker.proc.wait(timeout=120) == 1
    # Rank 0 finds its peer gone at its next step (in a LeaderWorkerSet the pods go first): that
    # request fails with an error, and node 0 exits for a restart as a whole, not in place.
    client = openai.OpenAI(base_url=nodes.leader.url + "/v1", api_key="none", max_retries=0, timeout=120)
    with pytest.raises(openai.APIError):
        client.completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=0)
    assert nodes.leader.proc.wait(timeout=120) == 1
    for proc, why in ((nodes.worker, "the tensor-parallel rank 1 killed"), (nodes.leader, "engine failed")):
        text = proc.log_text()
        assert why in text and "this node exits and the group restarts as a whole" in text, text[-3000:]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["-tp", "2", "--nnodes", "2", "--node-rank", "2", "--master-addr", "x"], "not a node of --nnodes 2"),
        (["-tp", "3", "--nnodes", "2", "--master-addr", "x"], "does not split over --nnodes 2"),
        (["-tp", "2", "--nnodes", "2"], "needs --master-addr"),
        (["--node-rank", "1"], "needs --nnodes above it"),
        (["--headless"], "--headless: node rank 0 serves the API"),
    ],
)
def test_shares_that_cannot_run_are_refused_by_name(tiny_llama, args, says) -> None:
    assert says in refused(tiny_llama, *args)
