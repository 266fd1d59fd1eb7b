"""Never worse than importing: a snapshot of another key, changed bytes, a truncated image, a mapped
file that changed, no CRIU, CRIU killed mid-restore: the pod imports, says why in one log line and
in keepwarm_startup_source_total, serves, and no restored process is left behind."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from keepwarm_runtime.snapshot.store import IMAGES, MANIFEST, is_pages
from tests.integration.snapshot.conftest import Node, Pod, start_pod, startup_source, writable

pytestmark = pytest.mark.extended  # the snapshot's integration tests: `make test-extended`


@pytest.fixture(scope="module")
def snapshot(
    node: Node, criu: Path, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path]:
    """One snapshot taken by the node for the first pod (which imports)."""
    log = tmp_path_factory.mktemp("first") / "pod.log"
    pod = start_pod(tiny_llama, log, node.store, criu, node.socket_dir)
    try:
        pod.server.wait(timeout=600)
        node.wait_for(r"snapshots: took ")
    finally:
        pod.stop()
    [taken] = node.snapshots()
    yield taken


def _imports_because(pod: Pod, reason: str, *said: str) -> str:
    pod.server.wait(timeout=600)
    assert startup_source(pod.server) == ("imports", reason)
    log = pod.server.log_text()
    assert f"snapshots: importing ({reason})" in log
    for words in said:
        assert words in log, pod.server.log_tail()
    assert "restore" not in "".join(k for k in pod.server.metrics() if k.startswith("keepwarm_startup_phase"))
    return log


def _edit_manifest(copy: Path, edit) -> None:
    with writable(copy):
        manifest = json.loads((copy / MANIFEST).read_text())
        edit(manifest)
        (copy / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("field", ["packages", "cpu", "criu", "user"])
def test_a_snapshot_holding_another_key_is_refused_by_key(
    snapshot: Path, criu: Path, pods, store_copy, tmp_path: Path, field: str
) -> None:
    """A store entry named after this start's key whose manifest says another package set, CPU, CRIU
    or user (another image's or node's snapshot, or a tampered one)."""
    copy = store_copy(snapshot)
    _edit_manifest(copy, lambda m: m["key"].update({field: "another " + field}))
    _imports_because(pods(copy.parent, criu), "mismatch", f"holds another key (fields {field})")


def test_a_snapshot_of_another_model_is_refused_by_key_naming_the_model(
    snapshot: Path, criu: Path, pods, store_copy, tmp_path: Path
) -> None:
    from keepwarm_runtime.modelgen import make_model

    other = make_model(tmp_path / "qwen", arch="qwen2", params="1M", dtype="bfloat16")
    copy = store_copy(snapshot)
    _imports_because(
        pods(copy.parent, criu, model=other), "mismatch", f"the nearest snapshot {copy.name} differs in model"
    )


def test_changed_page_bytes_are_refused_by_digest_and_nothing_restored_runs(
    snapshot: Path, criu: Path, pods, store_copy, tmp_path: Path
) -> None:
    copy = store_copy(snapshot)
    pages = next(p for p in (copy / IMAGES).iterdir() if is_pages(p.name))
    with writable(copy), open(pages, "r+b") as f:
        f.seek(pages.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    pod = pods(copy.parent, criu)
    _imports_because(pod, "digest", f"{pages} hashes to")
    _only_the_pods_own_processes(pod)


def test_a_truncated_image_is_refused_by_digest(
    snapshot: Path, criu: Path, pods, store_copy, tmp_path: Path
) -> None:
    copy = store_copy(snapshot)
    pages = next(p for p in (copy / IMAGES).iterdir() if is_pages(p.name))
    with writable(copy):
        os.truncate(pages, pages.stat().st_size // 3)
    _imports_because(pods(copy.parent, criu), "digest")


def test_a_changed_metadata_image_is_refused_before_any_restore(
    snapshot: Path, criu: Path, pods, store_copy, tmp_path: Path
) -> None:
    copy = store_copy(snapshot)
    core = next((copy / IMAGES).glob("core-*.img"))
    with writable(copy):
        data = core.read_bytes()
        core.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    log = _imports_because(pods(copy.parent, criu), "digest", f"{core} hashes to")
    assert "criu restore" not in log


def test_a_mapped_file_that_changed_is_refused(
    snapshot: Path, criu: Path, pods, store_copy, tmp_path: Path
) -> None:
    copy = store_copy(snapshot)
    _edit_manifest(copy, lambda m: m["mapped"][0].update({"size": m["mapped"][0]["size"] + 1}))
    _imports_because(pods(copy.parent, criu), "files", "differs (size")


def test_a_malformed_manifest_is_refused(
    snapshot: Path, criu: Path, pods, store_copy, tmp_path: Path
) -> None:
    copy = store_copy(snapshot)
    with writable(copy):
        (copy / MANIFEST).write_text('{"key": 1')
    _imports_because(pods(copy.parent, criu), "manifest")


def test_no_criu_imports(snapshot: Path, pods, store_copy, tmp_path: Path) -> None:
    copy = store_copy(snapshot)
    _imports_because(pods(copy.parent, tmp_path / "no-such-criu"), "no_criu", "no CRIU binary")


def test_criu_killed_mid_restore_imports_and_leaves_nothing(
    snapshot: Path, criu: Path, pods, store_copy, tmp_path: Path
) -> None:
    """A CRIU that is killed while it restores (a wrapper SIGKILLs the real one 0.3 s in): the pod
    imports, and no half-restored process is left in it."""
    copy = store_copy(snapshot)
    killer = tmp_path / "criu-killed"
    killer.write_text(
        "#!/bin/bash\n"
        f'case "$1" in restore) "{criu}" "$@" & pid=$!; sleep 0.3; kill -KILL $pid; exit 137;; esac\n'
        f'exec "{criu}" "$@"\n'
    )
    killer.chmod(killer.stat().st_mode | stat.S_IXUSR)
    pod = pods(copy.parent, killer)
    _imports_because(pod, "restore_failed", "criu restore exited 137")
    _only_the_pods_own_processes(pod)


def _only_the_pods_own_processes(pod: Pod) -> None:
    """The pod's PID namespace holds the launcher (now the importing parent) and its worker only."""
    launcher = pod.launcher_pid
    ns = os.readlink(f"/proc/{launcher}/ns/pid")
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/pid") == ns:
                    members.append(int(entry))
            except OSError:
                continue
    assert len(members) == 2, members  # the parent (PID 1) and its one worker


def test_a_damaged_snapshot_is_checked_by_the_node_and_taken_anew(
    snapshot: Path, node: Node, criu: Path, pods
) -> None:
    """The node's own snapshot damaged on disk: the pod imports (digest) and says so; the node checks
    it in full, removes it and takes it anew; the next pod restores. (Last: it spoils the module's
    snapshot.)"""
    pages = next(p for p in (snapshot / IMAGES).iterdir() if is_pages(p.name))
    with writable(snapshot), open(pages, "r+b") as f:
        f.seek(4096)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    taken_before = len(node.wait_for(r"snapshots: took "))
    _imports_because(pods(node.store, criu, node.socket_dir), "digest")
    [line] = node.wait_for(rf"snapshots: {snapshot.name} does not hold up")
    assert "hashes to" in line and "removed, taking it again" in line
    node.wait_for(r"snapshots: took ", count=taken_before + 1)
    pod = pods(node.store, criu, node.socket_dir)
    pod.server.wait(timeout=300)
    assert startup_source(pod.server) == ("snapshot", "hit")
