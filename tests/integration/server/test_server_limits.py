"""Limits: 413 before reading a huge body, surrogates and deep JSON as 400, request templates refused,
and /health answering throughout."""

from __future__ import annotations

import select
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest

FIFTY_MB = 50 * 1024 * 1024
LOOPING_TEMPLATE = "{% for i in range(100000000) %}{% endfor %}{{ messages[0]['content'] }}"


def _health_seconds(url: str) -> float:
    started = time.perf_counter()
    assert httpx.get(url + "/health", timeout=5).status_code == 200
    return time.perf_counter() - started


def _send_huge_body(url: str, chunked: bool) -> bytes:
    """POST a 50 MB completions body over a raw socket; return what the server answered."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
    framing = b"Transfer-Encoding: chunked\r\n" if chunked else f"Content-Length: {FIFTY_MB}\r\n".encode()
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + framing + b"\r\n"
    )
    sock.sendall(head)
    block = b'{"prompt": "' + b"a" * (1024 * 1024)
    try:
        for _ in range(50):
            sock.sendall(f"{len(block):x}\r\n".encode() + block + b"\r\n" if chunked else block)
    except OSError:
        pass  # the server answered and closed: exactly what a limit should do
    answer = b""
    try:
        while chunk := sock.recv(65536):
            answer += chunk
            if b"\r\n\r\n" in answer and b"}" in answer.split(b"\r\n\r\n", 1)[1]:
                break
    except OSError:
        pass
    sock.close()
    return answer


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_50_mb_body_gets_413_while_health_answers(served, chunked):
    result: dict[str, bytes] = {}
    sender = threading.Thread(
        target=lambda: result.setdefault("answer", _send_huge_body(served.proc.url, chunked))
    )
    sender.start()
    worst = max(_health_seconds(served.proc.url) for _ in range(5))
    sender.join(120)
    assert result["answer"].startswith(b"HTTP/1.1 413"), result["answer"][:200]
    assert b"request_too_large" in result["answer"]
    assert worst < 1.0


def _send_all_then_read(url: str, path: str, length: int, extra_headers: bytes = b"") -> bytes:
    """Send the head, wait until the server has answered (an early refusal), then send the whole
    declared body anyway (as urllib, httpx and the openai client do) and only then read the answer."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=60) as sock:
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n".encode()
        sock.sendall(head + b"Content-Type: application/json\r\n" + extra_headers + b"\r\n")
        readable, _, _ = select.select([sock], [], [], 60)
        assert readable, "the server did not answer before the body was sent"
        time.sleep(0.5)  # without lingering, the server has closed by now
        block = b" " * (1024 * 1024)
        for start in range(0, length, len(block)):
            sock.sendall(block[: length - start])
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        return answer


def test_an_early_413_reaches_a_client_that_sends_its_whole_body_first(served):
    answer = _send_all_then_read(served.proc.url, "/v1/completions", 12 * 1024 * 1024)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"request_too_large" in answer


def test_an_early_401_reaches_a_client_that_sends_its_whole_body_first(served_secure):
    answer = _send_all_then_read(served_secure.proc.url, "/v1/completions", 4 * 1024 * 1024)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert b"invalid_api_key" in answer


def test_lone_surrogates_are_a_400(served):
    for path, body in (
        ("/v1/completions", '{"prompt": "\\ud800 hi", "max_tokens": 2}'),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\udfffb"}]}'),
        ("/tokenize", '{"prompt": "\\ud83d"}'),
    ):
        response = httpx.post(
            served.proc.url + path, content=body, headers={"content-type": "application/json"}, timeout=30
        )
        assert response.status_code == 400, (path, response.text)
        assert response.json()["error"]["code"] == "invalid_unicode"


def test_deeply_nested_json_is_a_400(served):
    for depth in (100, 100_000):
        body = '{"prompt": "x", "logit_bias": ' + "[" * depth + "]" * depth + "}"
        response = httpx.post(
            served.proc.url + "/v1/completions", content=body, headers={"content-type": "application/json"}
        )
        assert response.status_code == 400, response.text
        assert "nested deeper" in response.json()["error"]["message"]


def test_request_chat_templates_are_refused_without_trust(served):
    messages = [{"role": "user", "content": "hi"}]
    for extra in (
        {"chat_template": LOOPING_TEMPLATE},
        {"chat_template_kwargs": {"chat_template": LOOPING_TEMPLATE}},
    ):
        started = time.perf_counter()
        response = httpx.post(
            served.proc.url + "/v1/chat/completions", json={"messages": messages, **extra}, timeout=30
        )
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "chat_template"
        assert "--trust-request-chat-template" in response.json()["error"]["message"]
        assert time.perf_counter() - started < 5
    reserved = httpx.post(
        served.proc.url + "/v1/chat/completions",
        json={"messages": messages, "chat_template_kwargs": {"tokenize": True}},
    )
    assert (
        reserved.status_code == 400 and reserved.json()["error"]["param"] == "chat_template_kwargs.tokenize"
    )
