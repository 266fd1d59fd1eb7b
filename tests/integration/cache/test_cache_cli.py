"""`keepwarm cache ...` on bad input: one line naming the problem, exit code 2, never a traceback."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch


def cache_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "keepwarm_runtime.cli", "cache", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_one_line_error(out: subprocess.CompletedProcess, *needles: str) -> None:
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if not line.startswith("usage:") and line.strip()]
    assert len(lines) == 1, out.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def foreign_server(path: Path, answer: bytes) -> socket.socket:
    """A Unix socket that is not a keepwarm daemon: it writes ``answer`` to each client and closes."""
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.listen(8)

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.sendall(answer)

    threading.Thread(target=serve, daemon=True).start()
    return listener


@pytest.mark.parametrize(
    ("cmd", "answer"),
    [
        ("stats", b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n"),
        ("ls", b""),
        ("stats", b"\x00\x00\x00\x05[1,2]"),
    ],
)
def test_inspect_a_foreign_socket(tmp_path, cmd, answer):
    path = tmp_path / "foreign.sock"
    listener = foreign_server(path, answer)
    try:
        assert_one_line_error(cache_cli(cmd, "--socket", str(path)), f"keepwarm cache {cmd}:")
    finally:
        listener.close()


def test_inspect_a_missing_socket(tmp_path):
    assert_one_line_error(cache_cli("stats", "--socket", str(tmp_path / "nope.sock")), "no daemon socket")


def test_release_unknown_model(checkpoint_writer, daemon_factory, tmp_path):
    model = checkpoint_writer(tmp_path / "models" / "m", seed=1)
    daemon = daemon_factory(tmp_path / "wc", [model]).wait_ready()
    assert_one_line_error(
        cache_cli("release", "--socket", str(daemon.socket), "ghost"), "no resident model named"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_serve_gpu_tier_without_cuda(checkpoint_writer, tmp_path):
    model = checkpoint_writer(tmp_path / "models" / "m", seed=1)
    out = cache_cli("serve", "--socket-dir", str(tmp_path / "wc"), "--tier", "gpu", "--model", str(model))
    assert_one_line_error(out, "keepwarm cache serve:")


@pytest.mark.parametrize("budget", ["inf", "nan", "-1GiB", "1e400", "lots"])
def test_serve_bad_budget(tmp_path, budget):
    out = cache_cli("serve", "--socket-dir", str(tmp_path / "wc"), "--budget", budget)
    assert_one_line_error(out, "--budget")


def test_serve_socket_dir_is_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    out = cache_cli("serve", "--socket-dir", str(tmp_path / "file" / "wc"))
    assert_one_line_error(out, "keepwarm cache serve:")


def test_serve_socket_path_past_af_unix_limit_is_refused_before_loading(checkpoint_writer, tmp_path):
    """A per-GPU socket is named after the GPU's UUID: under a deep directory only the socket fails to fit.
    Refused by name before any model is read (one line: no "loaded" log before it)."""
    model = checkpoint_writer(tmp_path / "models" / "m", seed=1)
    deep = tmp_path / ("d" * 40) / "wc"
    gpu = "GPU-c349ec48-74d5-38a9-3f78-1a309601a729"
    out = cache_cli("serve", "--socket-dir", str(deep), "--fake-gpu", gpu, "--model", str(model))
    assert_one_line_error(out, "keepwarm cache serve:", "AF_UNIX allows 107", gpu)
