"""The node's side: a take killed mid-dump, a full disk or an over-budget snapshot leave nothing in
the store; least recently used snapshots make room; a runtime uid cannot write (or, in another
group, read) the store; malformed requests are refused by name and hurt no later request."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from keepwarm_api.sockets import SNAPSHOT_SOCKET
from keepwarm_runtime.cache.protocol import encode, recv_frame, send_frame
from keepwarm_runtime.snapshot import client
from keepwarm_runtime.snapshot.criu import version
from keepwarm_runtime.snapshot.key import SnapshotKey, import_env, snapshot_key, this_process_user
from keepwarm_runtime.snapshot.store import MANIFEST, Store
from tests.integration.snapshot.conftest import Node, start_node

RUNTIME_UID = 10001  # the runtime image's user

pytestmark = pytest.mark.extended


def _ask(node: Node, criu: Path, model: Path) -> SnapshotKey:
    """Ask ``node`` for a snapshot of ``model`` as this process (root) would restore it."""
    config = (model / "config.json").read_bytes()
    key = snapshot_key(config, os.environ, version(str(criu)), this_process_user())
    client.ask_for_snapshot(str(node.socket_dir), key, config, dict(os.environ))
    return key


def _nothing_left(node: Node) -> None:
    assert node.snapshots() == []
    assert not list(node.store.glob(".tmp-*"))


def test_criu_killed_mid_dump_leaves_no_snapshot(tmp_path: Path, criu: Path, tiny_llama: Path) -> None:
    killer = tmp_path / "criu-killed"
    killer.write_text(
        "#!/bin/bash\n"
        f'case "$1" in dump) "{criu}" "$@" & pid=$!; sleep 0.3; kill -KILL $pid; exit 137;; esac\n'
        f'exec "{criu}" "$@"\n'
    )
    killer.chmod(killer.stat().st_mode | stat.S_IXUSR | stat.S_IXOTH)
    node = start_node(tmp_path, killer)
    try:
        _ask(node, criu, tiny_llama)
        [line] = node.wait_for(r"snapshots: no snapshot of")
        assert "criu dump exited 137" in line
        _nothing_left(node)
        _ask(node, criu, tiny_llama)  # the service is not stuck: it takes again
        assert len(node.wait_for(r"snapshots: no snapshot of", count=2)) == 2
    finally:
        node.stop()


def test_a_snapshot_over_the_budget_is_not_kept(tmp_path: Path, criu: Path, tiny_llama: Path) -> None:
    node = start_node(tmp_path, criu, "--snapshot-budget", "1MiB")
    try:
        _ask(node, criu, tiny_llama)
        [line] = node.wait_for(r"snapshots: no snapshot of")
        assert "over budget" in line and f"budget {1 << 20}" in line
        _nothing_left(node)
    finally:
        node.stop()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "small"
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_full_disk_takes_no_snapshot(
    tmp_path: Path, small_disk: Path, criu: Path, tiny_llama: Path
) -> None:
    node = start_node(tmp_path, criu, store=small_disk / "store")
    try:
        _ask(node, criu, tiny_llama)
        [line] = node.wait_for(r"snapshots: no snapshot of")
        assert "disk full" in line or "No space left" in line
        _nothing_left(node)
    finally:
        node.stop()


@pytest.fixture(scope="module")
def lru_node(tmp_path_factory: pytest.TempPathFactory, criu: Path, tiny_llama: Path) -> Iterator[Node]:
    """A node whose budget holds one snapshot (and a half): a second key evicts the first."""
    node = start_node(tmp_path_factory.mktemp("lru"), criu)
    _ask(node, criu, tiny_llama)
    node.wait_for(r"snapshots: took ")
    node.daemon.terminate()  # the store stays for the next node
    size = sum(p.stat().st_size for p in node.store.rglob("*") if p.is_file())
    node = start_node(node.store.parent, criu, "--snapshot-budget", str(size * 3 // 2), store=node.store)
    yield node
    node.stop()


def test_the_least_recently_used_snapshot_makes_room(lru_node: Node, criu: Path, tmp_path_factory) -> None:
    from keepwarm_runtime.modelgen import make_model

    [first] = lru_node.snapshots()
    other = make_model(tmp_path_factory.mktemp("qwen"), arch="qwen2", params="1M", dtype="bfloat16")
    key = _ask(lru_node, criu, other)
    lru_node.wait_for(r"snapshots: took ")
    assert [line for line in lru_node.daemon.lines if f"evicting {first.name}" in line]
    assert [p.name for p in lru_node.snapshots()] == [key.digest()]
    entries = Store(lru_node.store).entries()
    assert [e.digest for e in entries] == [key.digest()] and entries[0].usage.restores == 0


def _as_runtime_uid(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            "setpriv",
            f"--reuid={RUNTIME_UID}",
            f"--regid={RUNTIME_UID}",
            "--clear-groups",
            "--inh-caps=-all",
            *command,
        ],
        capture_output=True,
        text=True,
    )


def test_a_runtime_uid_cannot_write_the_store(lru_node: Node) -> None:
    [snapshot] = lru_node.snapshots()
    attempts = {
        "create in the store": ("touch", str(lru_node.store / "planted")),
        "create in a snapshot": ("touch", str(snapshot / "planted")),
        "rewrite a manifest": ("sh", "-c", f"echo {{}} > {snapshot / MANIFEST}"),
        "rename a snapshot": ("mv", str(snapshot), str(lru_node.store / "moved")),
        "remove a snapshot": ("rm", "-rf", str(snapshot)),
        "read another group's snapshot": ("cat", str(snapshot / MANIFEST)),
    }
    for what, command in attempts.items():
        done = _as_runtime_uid(*command)
        assert done.returncode != 0 and "Permission denied" in done.stderr, (what, done)
    assert [p.name for p in lru_node.snapshots()] == [snapshot.name]
    assert not (lru_node.store / "planted").exists()


def _exchange(node: Node, raw: bytes) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(node.socket_dir / SNAPSHOT_SOCKET))
        sock.sendall(raw)
        reply, _ = recv_frame(sock)
    return reply


def test_malformed_requests_are_refused_by_name_and_hurt_no_later_one(
    lru_node: Node, criu: Path, tiny_llama: Path
) -> None:
    config = (tiny_llama / "config.json").read_text()
    key = snapshot_key(config.encode(), os.environ, version(str(criu)), this_process_user())
    other = {**key.wire(), "packages": "another image"}
    cases = {
        b"\xff\xff\xff\xffgarbage": "too_large",
        encode({"cmd": "drop tables"}): "unknown_command",
        encode({"cmd": "snapshot", "key": {"format": 1}, "config_json": config, "env": {}}): "bad_request",
        encode({"cmd": "snapshot", "key": key.wire(), "config_json": config, "env": ["A=1"]}): "bad_request",
        encode(
            {"cmd": "snapshot", "key": key.wire(), "config_json": config, "env": {"A=B": "1"}}
        ): "bad_request",
        encode({"cmd": "restored", "key_digest": "../../etc"}): "bad_request",
        encode(
            {"cmd": "snapshot", "key": other, "config_json": config, "env": import_env(os.environ)}
        ): "refused",
    }
    for raw, code in cases.items():
        reply = _exchange(lru_node, raw)
        assert reply["ok"] is False and reply["error"]["code"] == code, (raw[:40], reply)
    refused = _exchange(lru_node, list(cases)[-1])
    assert "fields packages" in refused["error"]["message"]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:  # a client that sends half a frame
        sock.connect(str(lru_node.socket_dir / SNAPSHOT_SOCKET))
        sock.sendall(b"\x00\x00\x01\x00{")
        time.sleep(0.2)
    [snapshot] = lru_node.snapshots()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(lru_node.socket_dir / SNAPSHOT_SOCKET))
        send_frame(sock, {"cmd": "restored", "key_digest": snapshot.name})
        reply, _ = recv_frame(sock)
    assert reply == {"ok": True, "counted": True, "nfds": 0}
