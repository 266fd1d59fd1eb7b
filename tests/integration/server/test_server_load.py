"""Many concurrent streams, and clients that vanish mid-request, against a real server."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from urllib.parse import urlparse

import openai
import pytest


def _wait_idle(served, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = served.proc.get_json("/debug/stats")
        if (stats["num_running"] == 0 and stats["num_waiting"] == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def test_32_concurrent_streams_all_complete_and_server_stays_healthy(served):
    client = openai.AsyncOpenAI(
        base_url=served.proc.url + "/v1", api_key="unused", max_retries=0, timeout=120
    )

    async def one(i: int) -> tuple[str, str | None]:
        stream = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": f"stream {i}"}],
            max_tokens=24,
            seed=i,
            stream=True,
        )
        text, finish = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def main():
        try:
            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await client.close()

    results = asyncio.run(main())
    assert len(results) == 32 and all(finish in ("stop", "length") for _, finish in results)
    assert served.proc.get_json("/health")["status"] == "ok"
    stats = _wait_idle(served)
    assert (stats["num_running"], stats["num_waiting"], stats["kv_cache_usage"]) == (0, 0, 0.0)


def _open_request(url: str, body: dict) -> socket.socket:
    parsed = urlparse(url)
    payload = json.dumps(body).encode()
    sock = socket.create_connection((parsed.hostname, parsed.port))
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {parsed.hostname}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    sock.sendall(head.encode() + payload)
    return sock


def _running(served) -> float:
    return served.proc.metrics()["keepwarm_num_requests_running"]


@pytest.mark.parametrize("stream", [True, False])
def test_abrupt_disconnect_frees_the_sequence(served, stream):
    _wait_idle(served)
    aborts = served.proc.metrics()["keepwarm_request_aborts_total"]
    body = {"model": "tiny", "prompt": "x", "max_tokens": 480, "ignore_eos": True, "stream": stream}
    sock = _open_request(served.proc.url, body)
    if stream:
        sock.settimeout(60)
        received = b""
        while b"data:" not in received:  # headers and the first event may come in separate segments
            chunk = sock.recv(4096)
            assert chunk, received
            received += chunk
    deadline = time.monotonic() + 30
    while _running(served) < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _running(served) == 1
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST on close
    sock.close()
    stats = _wait_idle(served, timeout=10)
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    metrics = served.proc.metrics()
    assert metrics["keepwarm_num_requests_running"] == 0
    assert metrics["keepwarm_kv_cache_usage_ratio"] == 0.0
    assert metrics["keepwarm_request_aborts_total"] == aborts + 1  # aborted, not run to completion
    if not stream:  # the handler saw the disconnect itself and answered (to no one) 499
        closed = 'keepwarm_http_requests_total{endpoint="/v1/completions",status="499"}'
        deadline = time.monotonic() + 10
        while served.proc.metrics().get(closed, 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert served.proc.metrics().get(closed, 0) == 1
    assert served.proc.get_json("/health")["status"] == "ok"
