"""10,000 malformed frames from 4 processes: every one answered, nothing leaked, the cache intact."""

from __future__ import annotations

import collections
import json
import multiprocessing
import os
import random
import socket
import struct
import time
from pathlib import Path

import torch

from keepwarm_runtime.cache import protocol
from keepwarm_runtime.cache.client import attach
from keepwarm_runtime.cache.fingerprint import compute_key

FRAMES, PROCESSES = 10_000, 4


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def malformed(rng: random.Random, i: int, key: dict) -> tuple[bytes, list[int]]:
    """The i-th hostile frame (bytes and fds to send with it); every kind a decoder can trip on."""
    kind = i % 8
    if kind == 0:  # random bytes
        return rng.randbytes(rng.randint(1, 300)), []
    if kind == 1:  # huge lengths
        return struct.pack(">I", rng.choice([protocol.MAX_REQUEST_BYTES + 1, 1 << 31, 0xFFFFFFFF])), []
    if kind == 2:  # truncation: the prefix promises more than ever comes
        body = json.dumps({"cmd": "hello"}).encode()
        return _frame(body)[: rng.randint(1, len(body) + 3)], []
    if kind == 3:  # deep nesting
        depth = rng.randint(1000, 60000)
        return _frame(b"[" * depth + b"]" * rng.choice([0, depth])), []
    if kind == 4:  # huge numbers
        return _frame(b'{"cmd": "hello", "n": ' + b"9" * rng.randint(4301, 20000) + b"}"), []
    if kind == 5:  # wrong types
        bad_key = dict(key, **rng.choice([{"tp_rank": "0"}, {"dtype": 3}, {"files": None}, {"version": [1]}]))
        header = rng.choice(
            [
                {"cmd": ["hello"]},
                {"cmd": "get_state", "key": [1, 2]},
                {"cmd": "get_state", "key": bad_key},
                {"cmd": "get_state", "key": key, "name": 5},
                {"cmd": "release", "model": {"a": 1}},
                {"cmd": "release", "model": "x", "force": "yes"},
                {"cmd": "hello", "nfds": "0"},
                ["not", "an", "object"],
                "string",
            ]
        )
        return _frame(json.dumps(header).encode()), []
    if kind == 6:  # unsolicited fds, announced or not, or too many
        count = rng.choice([1, 3, protocol.MAX_FDS + 4])
        fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(count)]
        announced = rng.choice([0, count])
        return _frame(json.dumps({"cmd": "hello", "nfds": announced}).encode()), fds
    return _frame(b"\xff\xfe" + rng.randbytes(20)), []  # not UTF-8


def worker(args: tuple[str, int, dict]) -> dict[str, int]:
    path, seed, key = args
    rng = random.Random(seed)
    seen: collections.Counter[str] = collections.Counter()
    for i in range(FRAMES // PROCESSES):
        data, fds = malformed(rng, i + seed, key)
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(60)
            s.connect(path)
            try:
                if fds:
                    socket.send_fds(s, [data], fds)
                else:
                    s.sendall(data)
                s.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # the daemon may answer and close before reading everything
            finally:
                for fd in fds:
                    os.close(fd)
            try:
                reply, got = protocol.recv_frame(s)
                for fd in got:
                    os.close(fd)
                seen[reply["error"]["code"] if not reply.get("ok") else "ok"] += 1
            except protocol.PeerClosed:
                seen["closed"] += 1
            except protocol.ProtocolError as exc:
                seen[f"client:{exc.code}"] += 1
    return dict(seen)


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def thread_count(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:")))


def test_10000_malformed_frames_leak_nothing(checkpoint_writer, daemon_factory, tmp_path, assert_cached):
    model = checkpoint_writer(tmp_path / "models" / "m", seed=11)
    daemon = daemon_factory(tmp_path / "wc", [model]).wait_ready()
    pid = daemon.proc.pid
    assert attach(model, tmp_path / "wc", dtype=torch.bfloat16, fallback=False).source == "cache"
    time.sleep(0.5)
    fds_before, threads_before = fd_count(pid), thread_count(pid)
    key = compute_key(model, torch.bfloat16).to_dict()

    with multiprocessing.get_context("fork").Pool(PROCESSES) as pool:
        counts = pool.map(worker, [(str(daemon.socket), seed, key) for seed in range(PROCESSES)])
    total: collections.Counter[str] = collections.Counter()
    for c in counts:
        total.update(c)
    assert sum(total.values()) == FRAMES
    assert set(total) <= {
        "bad_json",
        "too_large",
        "truncated",
        "bad_fds",
        "bad_request",
        "ok",
        "unknown_command",
    }, total
    assert total["ok"] < FRAMES // 8  # only "hello" frames whose fds were announced succeed

    deadline = time.monotonic() + 30
    while (fd_count(pid), thread_count(pid)) != (fds_before, threads_before):
        assert time.monotonic() < deadline, (fd_count(pid), fds_before, thread_count(pid), threads_before)
        time.sleep(0.2)
    assert daemon.proc.poll() is None
    assert "Traceback" not in daemon.stderr
    assert daemon.stderr.count("bad frame") < 200  # one rate-limited line, not one per frame
    assert_cached(attach(model, tmp_path / "wc", dtype=torch.bfloat16, fallback=False), model, torch.bfloat16)
