"""snapshot/store.py: digests catch any changed, missing or extra byte; lookups name why they miss;
the budget evicts the least recently used; installs are whole and sealed (no CRIU needed here)."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import blake3
import pytest

from keepwarm_runtime.snapshot.key import SnapshotKey
from keepwarm_runtime.snapshot.outcome import Reason
from keepwarm_runtime.snapshot.store import (
    IMAGES,
    MANIFEST,
    Entry,
    FileDigest,
    Found,
    Manifest,
    Miss,
    Store,
    Usage,
    image_digest,
    image_files,
    lookup,
    plan_eviction,
    verify_images,
    verify_pages,
)
from keepwarm_runtime.snapshot.wire import MappedFile

KEY = SnapshotKey(1, "0.1.0", "p", "s", "py", "text llama - 0", "cpu", "e", "c", "6.1", "4.1.1", "0:0:")


def _entry(digest: str, size: int, created: float, last_used: float = 0.0) -> Entry:
    return Entry(digest, size, created, Usage(0, last_used))


def test_eviction_takes_the_least_recently_used_first_and_only_what_it_must() -> None:
    entries = [_entry("a", 40, 1.0, last_used=9.0), _entry("b", 40, 2.0), _entry("c", 40, 3.0)]
    assert plan_eviction(entries, 40, budget=160) == []
    assert plan_eviction(entries, 40, budget=120) == ["b"]  # b: created 2.0, never used since
    assert plan_eviction(entries, 40, budget=80) == ["b", "c"]
    assert plan_eviction(entries, 200, budget=160) is None  # it cannot fit even alone
    assert plan_eviction(entries, 10**12, budget=None) == []


def _images(root: Path) -> Path:
    images = root / IMAGES
    images.mkdir(parents=True)
    (images / "core-1.img").write_bytes(b"core" * 10)
    (images / "pages-1.img").write_bytes(os.urandom(3 * 1024 + 5))
    return images


def test_file_digests_are_blake3_of_every_byte(tmp_path: Path) -> None:
    images = _images(tmp_path)
    (images / "empty.img").write_bytes(b"")
    files = image_files(images)
    pages = images / "pages-1.img"
    assert files["core-1.img"].size == 40 and files["pages-1.img"].size == 3 * 1024 + 5
    assert files["pages-1.img"].blake3 == blake3.blake3(pages.read_bytes()).hexdigest()
    assert files["empty.img"] == FileDigest(0, blake3.blake3(b"").hexdigest())
    assert image_files(images, workers=1) == files  # one thread or several: the same digests
    data = bytearray(pages.read_bytes())
    data[2048] ^= 1
    pages.write_bytes(bytes(data))
    assert "pages-1.img hashes to" in verify_images(images, files, pages=True)
    assert verify_images(images, files, pages=False) is None  # the other files are intact
    assert image_digest(image_files(images)) != image_digest(files)


def test_missing_extra_and_truncated_files_are_named(tmp_path: Path) -> None:
    images = _images(tmp_path)
    files = image_files(images)
    (images / "extra.img").write_bytes(b"x")
    assert "has extra ['extra.img']" in verify_images(images, files, pages=False)
    (images / "extra.img").unlink()
    os.truncate(images / "pages-1.img", 100)
    assert "(100 bytes), recorded" in verify_images(images, files, pages=True)
    (images / "core-1.img").unlink()
    assert "lacks ['core-1.img']" in verify_images(images, files, pages=True)


def _installed(
    tmp_path: Path, key: SnapshotKey = KEY, mapped: tuple[MappedFile, ...] = ()
) -> tuple[Store, Path]:
    if os.geteuid() != 0:
        pytest.skip("an install seals the snapshot as root's")
    store = Store(tmp_path / "store")
    store.prepare()
    temp = store.temp_dir(key.digest())
    files = image_files(_images(temp))
    manifest = Manifest(key, files, image_digest(files), 1.0, 41, {"stdout": "pipe:[1]"}, mapped)
    return store, store.install(temp, manifest, gid=os.getgid())


def test_an_install_is_sealed_read_only_and_found_whole(tmp_path: Path) -> None:
    exe = Path(os.__file__)
    st = exe.stat()
    store, path = _installed(tmp_path, mapped=(MappedFile(str(exe), st.st_size, st.st_mtime_ns),))
    assert path.name == KEY.digest() and (path.stat().st_mode & 0o777) == 0o550
    assert all((p.stat().st_mode & 0o777) in (0o440, 0o550) for p in path.rglob("*"))
    found = lookup(store.root, KEY)
    assert isinstance(found, Found) and verify_pages(found) is None
    assert [e.digest for e in store.entries()] == [KEY.digest()]
    assert store.note_restore(KEY.digest()) and store.entries()[0].usage.restores == 1
    assert not store.note_restore("0" * 32)
    store.remove(KEY.digest())
    assert store.entries() == [] and not path.exists()


def test_lookups_name_why_they_miss(tmp_path: Path) -> None:
    root = tmp_path / "empty"
    root.mkdir()
    assert lookup(root, KEY) == Miss(Reason.ABSENT, f"no snapshot in {root}")
    store, path = _installed(tmp_path, mapped=(MappedFile("/no/such/lib.so", 1, 1),))
    other = replace(KEY, cpu="another", packages="another")
    miss = lookup(store.root, other)
    assert miss.reason is Reason.MISMATCH and f"{path.name} differs in packages, cpu" in miss.detail
    assert lookup(store.root, KEY) == Miss(Reason.FILES, "/no/such/lib.so is missing")
    os.chmod(path, 0o750)
    os.chmod(path / MANIFEST, 0o640)
    manifest = json.loads((path / MANIFEST).read_text())
    (path / MANIFEST).write_text(json.dumps({**manifest, "image_digest": "0" * 64}))
    assert lookup(store.root, KEY).reason is Reason.MANIFEST
    (path / MANIFEST).write_text("{")
    assert lookup(store.root, KEY).reason is Reason.MANIFEST
