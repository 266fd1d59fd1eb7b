"""The test kubelet's atomic writer (keepwarm_testing pods/volumes.py): the kubelet's layout, one
rename per update, nothing left of the old content, item paths kept inside the volume."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from keepwarm_testing.controlplane.pods.volumes import DATA_LINK, VolumeError, _add, atomic_write


def read(directory: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in directory.iterdir() if not p.name.startswith("..")}


def test_the_kubelet_layout_and_in_place_updates(tmp_path: Path):
    assert atomic_write(tmp_path, {"a.json": (b"1", 0o644), "sub/b": (b"2", 0o600)})
    data = tmp_path / DATA_LINK
    assert data.is_symlink() and os.readlink(data).startswith("..") and "/" not in os.readlink(data)
    assert os.readlink(tmp_path / "a.json") == f"{DATA_LINK}/a.json"
    assert (tmp_path / "sub" / "b").read_text() == "2" and (
        tmp_path / "sub" / "b"
    ).stat().st_mode & 0o777 == 0o600
    first = data.resolve()
    assert not atomic_write(tmp_path, {"a.json": (b"1", 0o644), "sub/b": (b"2", 0o600)})  # same: untouched
    assert data.resolve() == first
    assert atomic_write(tmp_path, {"a.json": (b"3", 0o644)})
    assert read(tmp_path) == {"a.json": "3"}  # the key the object lost is gone, links and all
    assert (
        not first.exists() and len([p for p in tmp_path.iterdir() if p.is_dir() and not p.is_symlink()]) == 1
    )
    assert atomic_write(tmp_path, {"a.json": (b"3", 0o600)})  # a mode change is a change too


@pytest.mark.parametrize("rel", ["../x", "/etc/x", "..data", "a/../../x", ""])
def test_item_paths_stay_inside_the_volume(rel: str):
    with pytest.raises(VolumeError, match="leaves its volume"):
        _add({}, rel, b"", 0o644)
