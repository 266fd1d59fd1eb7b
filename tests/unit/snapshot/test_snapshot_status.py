"""The node agent reports the store's snapshots under its WeightCacheNode's status.snapshots[], newest
first with their restores, and a new snapshot or restore is a status change to write."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from keepwarm_api.weightcachenode import WeightCacheNodeStatus
from keepwarm_runtime.agent.kubernetes import NodeAgent
from keepwarm_runtime.agent.state import status_differs
from keepwarm_runtime.cache.security import PeerPolicy
from keepwarm_runtime.snapshot.key import SnapshotKey
from keepwarm_runtime.snapshot.service import ServiceSettings, SnapshotService
from keepwarm_runtime.snapshot.store import IMAGES, Manifest, Store, image_digest, image_files

KEY = SnapshotKey(1, "0.1.0", "p", "s", "py", "text llama - 0", "cpu", "e", "c", "6.1", "4.1.1", "0:0:")


def _install(store: Store, key: SnapshotKey, created: float) -> str:
    temp = store.temp_dir(key.digest())
    (temp / IMAGES).mkdir()
    (temp / IMAGES / "pages-1.img").write_bytes(b"p" * 100)
    files = image_files(temp / IMAGES)
    store.install(temp, Manifest(key, files, image_digest(files), created, 1, {}, ()), gid=os.getgid())
    return key.digest()


def test_the_agent_reports_the_stores_snapshots_newest_first(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("an install seals the snapshot as root's")
    service = SnapshotService(ServiceSettings(tmp_path, tmp_path / "store", "criu", None, None, PeerPolicy()))
    service.store.prepare()
    old = _install(service.store, KEY, created=1_000.0)
    agent = NodeAgent([], "wc", "node-1", kube=None, snapshots=service)
    before = WeightCacheNodeStatus(snapshots=agent.snapshot_rows())
    new = _install(service.store, replace(KEY, cpu="other"), created=2_000.0)
    service.store.note_restore(old)
    rows = agent.snapshot_rows()
    assert [(r.key, r.bytes, r.restores) for r in rows] == [(new, 100, 0), (old, 100, 1)]
    assert rows[1].created.timestamp() == 1_000.0
    assert status_differs(before.wire(), WeightCacheNodeStatus(snapshots=rows))
    assert not status_differs(
        WeightCacheNodeStatus(snapshots=rows).wire(), WeightCacheNodeStatus(snapshots=rows)
    )
    assert NodeAgent([], "wc", "node-1", kube=None).snapshot_rows() == []  # no service, no rows
