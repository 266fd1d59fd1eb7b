"""Client against a real daemon process: fallback, zero-copy, identical logits, concurrency, security."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from keepwarm_runtime.cache import protocol
from keepwarm_runtime.cache.client import CacheAttachError, attach

NOBODY = 65534

ATTACH_SCRIPT = """
import hashlib, json, sys, torch
from keepwarm_runtime.cache.client import attach
res = attach(sys.argv[1], sys.argv[2], dtype=torch.float32, fallback=False)
h = hashlib.sha256()
for name in sorted(res.tensors):
    h.update(name.encode()); h.update(res.tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
print(json.dumps({"source": res.source, "sha": h.hexdigest(), "digest": res.digest}), flush=True)
if len(sys.argv) > 3:
    next(iter(res.tensors.values())).fill_(1.0)   # read-only pages: this must crash
    print("WROTE", flush=True)
"""


def _tensor_sha(tensors: dict[str, torch.Tensor]) -> str:
    import hashlib

    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def test_cold_start_without_daemon_falls_back(tiny_llama: Path, tmp_path: Path):
    res = attach(tiny_llama, tmp_path / "no-daemon-here", dtype=torch.float32)
    assert res.source == "disk"
    assert res.reason.startswith("unavailable")
    assert res.tensors["model.embed_tokens.weight"].dtype == torch.float32
    with pytest.raises(CacheAttachError, match="no daemon socket"):
        attach(tiny_llama, tmp_path / "no-daemon-here", dtype=torch.float32, fallback=False)


def test_warm_attach_is_zero_copy_and_identical(warm_cache):
    res = attach(warm_cache.tiny, warm_cache.socket_dir, dtype=torch.float32, fallback=False)
    disk = attach(warm_cache.tiny, None, dtype=torch.float32)
    assert (res.source, res.reason, res.tier) == ("cache", None, "host")
    assert res.tensors.keys() == disk.tensors.keys()
    for name, t in disk.tensors.items():
        assert torch.equal(res.tensors[name], t), name
    maps = Path("/proc/self/maps").read_text()
    region = [line for line in maps.splitlines() if "keepwarm:" in line and "r--s" in line]
    assert region, "the arena is not mapped shared read-only"
    starts_ends = [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in region]
    ptr = res.tensors["model.embed_tokens.weight"].data_ptr()
    assert any(lo <= ptr < hi for lo, hi in starts_ends), "tensor memory is not inside the arena"


def test_logits_identical_to_from_pretrained(warm_cache):
    from transformers import AutoConfig, AutoModelForCausalLM

    res = attach(warm_cache.tiny, warm_cache.socket_dir, dtype=torch.float32, fallback=False)
    config = AutoConfig.from_pretrained(warm_cache.tiny)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(res.tensors, strict=False, assign=True)
    assert not unexpected
    model.tie_weights()
    rotary = model.model.rotary_emb  # non-persistent buffers are not in the checkpoint
    model.model.rotary_emb = type(rotary)(config=config)
    assert not [n for n, b in model.named_buffers() if b.is_meta]
    assert not [n for n, p in model.named_parameters() if p.is_meta], missing
    reference = AutoModelForCausalLM.from_pretrained(warm_cache.tiny, dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 42, 7, 3]])
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
    assert torch.equal(got, want)


def test_two_clients_at_once_in_fresh_processes(warm_cache):
    """Two restarted clients attach concurrently; the second then writes into the arena and must
    crash (the pages are mapped read-only) without harming the first or the daemon."""
    args = [sys.executable, "-c", ATTACH_SCRIPT, str(warm_cache.tiny), str(warm_cache.socket_dir)]
    procs = [
        subprocess.Popen(args + extra, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for extra in ([], ["write"])
    ]
    outs = [p.communicate(timeout=180) for p in procs]
    results = [json.loads(out.strip().splitlines()[0]) for out, _ in outs]
    disk_sha = _tensor_sha(attach(warm_cache.tiny, None, dtype=torch.float32).tensors)
    for r in results:
        assert r["source"] == "cache"
        assert r["sha"] == disk_sha
    assert procs[0].returncode == 0, outs[0][1]
    assert "WROTE" not in outs[1][0]
    assert procs[1].returncode in (-11, -7), outs[1][1]  # SIGSEGV (or SIGBUS): the write faulted
    again = attach(warm_cache.tiny, warm_cache.socket_dir, dtype=torch.float32, fallback=False)
    assert _tensor_sha(again.tensors) == disk_sha


def test_fingerprint_mismatch_names_the_field(warm_cache):
    res = attach(warm_cache.tiny, warm_cache.socket_dir, dtype=torch.bfloat16)
    assert (res.source, res.reason) == ("disk", "mismatch: dtype")
    with pytest.raises(CacheAttachError, match="differs in: dtype"):
        attach(warm_cache.tiny, warm_cache.socket_dir, dtype=torch.bfloat16, fallback=False)


def test_model_over_budget_at_start_is_refused_not_evicting(warm_cache):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "keepwarm_runtime.cli",
            "cache",
            "stats",
            "--socket",
            str(warm_cache.daemon.socket),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    stats = json.loads(out)
    models = stats["models"]
    assert set(models) == {warm_cache.tiny.name, "loaded"}
    assert models[warm_cache.tiny.name]["pinned"]
    assert stats["failed"]["unfit"]["state"] == "Failed"
    assert "--budget" in stats["failed"]["unfit"]["reason"]
    assert "WARNING" in warm_cache.daemon.stderr and "not loading" in warm_cache.daemon.stderr
    res = attach(warm_cache.unfit, warm_cache.socket_dir, dtype=torch.float32)
    assert (res.source, res.reason) == ("disk", "absent")
    assert attach(warm_cache.loaded, warm_cache.socket_dir, dtype=torch.float32).source == "cache"


def _raw(socket_path: Path, payload: bytes, *, shut: bool = False) -> dict | None:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(30)
        s.connect(str(socket_path))
        s.sendall(payload)
        if shut:
            s.shutdown(socket.SHUT_WR)
        try:
            reply, _ = protocol.recv_frame(s)
        except protocol.PeerClosed:
            return None
        with pytest.raises(protocol.PeerClosed):  # after a bad frame the daemon closes
            protocol.recv_frame(s)
        return reply


def _hello(socket_path: Path) -> dict:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(30)
        s.connect(str(socket_path))
        protocol.send_frame(s, {"cmd": "hello"})
        return protocol.recv_frame(s)[0]


def test_bad_frames_get_an_error_and_the_daemon_lives_on(warm_cache):
    sock = warm_cache.daemon.socket
    assert _raw(sock, struct.pack(">I", 8) + b"\x00garbage")["error"]["code"] == "bad_json"
    assert _raw(sock, struct.pack(">I", 1 << 30))["error"]["code"] == "too_large"
    assert _raw(sock, struct.pack(">I", 100) + b'{"cmd": "he', shut=True)["error"]["code"] == "truncated"
    assert _raw(sock, b"\x00\x00", shut=True)["error"]["code"] == "truncated"
    with socket.socket(socket.AF_UNIX) as s:  # a well-formed but unknown command keeps the connection
        s.connect(str(sock))
        protocol.send_frame(s, {"cmd": "format_disk"})
        assert protocol.recv_frame(s)[0]["error"]["code"] == "unknown_command"
        protocol.send_frame(s, {"cmd": "release", "model": warm_cache.tiny.name})
        assert protocol.recv_frame(s)[0]["error"]["code"] == "pinned"
        protocol.send_frame(s, {"cmd": "get_state", "key": {"dtype": "x"}})  # malformed: reply, close
        assert protocol.recv_frame(s)[0]["error"]["code"] == "bad_request"
        with pytest.raises(protocol.PeerClosed):
            protocol.recv_frame(s)
    assert _hello(sock)["ok"]
    assert warm_cache.daemon.proc.poll() is None


def _hello_as(uid: int, gid: int, socket_path: Path) -> dict:
    """Fork, drop to uid/gid, send hello, and return the daemon's reply (a forked child needs no
    interpreter the other user could not read: ours lives under /root)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: only sockets and json from here on
        try:
            os.close(r)
            os.setgroups([gid])
            os.setgid(gid)
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(30)
                s.connect(str(socket_path))
                with contextlib.suppress(BrokenPipeError):  # refused peers get a reply, then a close
                    protocol.send_frame(s, {"cmd": "hello"})
                reply = protocol.recv_frame(s)[0]
            os.write(w, json.dumps(reply).encode())
            os._exit(0)
        except BaseException as exc:
            os.write(w, json.dumps({"child_error": repr(exc)}).encode())
            os._exit(1)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    return json.loads(data)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as nobody")
def test_peer_with_another_uid_is_refused(warm_cache):
    # The socket is 0660 with group nogroup, so nobody can connect; SO_PEERCRED must still refuse it.
    reply = _hello_as(NOBODY, NOBODY, warm_cache.daemon.socket)
    assert reply.get("ok") is False, reply
    assert reply["error"]["code"] == "forbidden"
    assert "65534" in reply["error"]["message"]
    assert _hello(warm_cache.daemon.socket)["ok"]
