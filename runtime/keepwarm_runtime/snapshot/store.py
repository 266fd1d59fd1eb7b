"""The node's snapshot store: one directory per snapshot, named by its key's digest.

```
<store>/                  root, 0755: only the node agent writes here
  <key digest>/           0550 root:<gid of the snapshot's user>, its files 0440: what may restore it
    manifest.json         Manifest: the key, the images' digest and size, pipes, mapped files
    images/               CRIU's images
  .tmp-<key digest>-<n>/  a snapshot being taken (never read by a restore)
  .state.json             the agent's own record: restores and last use per snapshot (0600)
```

A snapshot appears by one rename of a complete directory whose digests were computed after the dump
(``install``), so a reader sees all of it or nothing. A restore checks, in order, that a directory
exists for its key and that its manifest holds that key (else it names the nearest snapshot's
differing fields), that every file the snapshot maps is the same file here (size and mtime), and
that every image file but the memory pages hashes to its recorded digest (``lookup``); the page
files, the bulk, are hashed while CRIU restores them and checked before the restored parent gets
its context (``verify_pages``): until then it sleeps in the read it was dumped in, and a mismatch
kills it before it runs. Any miss is a Reason, and the launcher imports instead.

Each file's digest is its BLAKE3 hash, read through a memory map, files in parallel threads: the
pages are read before every restore, beside CRIU, so their hash is on a restore's critical path. On
the 2-core AMX VM a 484 MB page file took 0.11-0.21 s with BLAKE3 on one thread against 0.45 s with
OpenSSL's sha256 (1.0-1.2 GB/s a core) and 0.55 s as 16 MiB chunks over two threads beside CRIU,
longer than CRIU's own restore (0.44 s).

Budget: the agent keeps the store under a byte budget by evicting the least recently used snapshots
(``plan_eviction``, pure) before installing a new one; one that does not fit alone is not kept.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import mmap
import os
import shutil
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import blake3

from keepwarm_runtime.snapshot.key import SnapshotKey, differing
from keepwarm_runtime.snapshot.outcome import Reason
from keepwarm_runtime.snapshot.wire import MappedFile

MANIFEST = "manifest.json"
IMAGES = "images"
STATE = ".state.json"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
MAX_MANIFEST_BYTES = 4 << 20


@dataclass(frozen=True)
class FileDigest:
    size: int
    blake3: str  # the file's BLAKE3 hash, hex


@dataclass(frozen=True)
class Manifest:
    """What the agent recorded when it took a snapshot."""

    key: SnapshotKey
    images: dict[str, FileDigest]  # every file of images/ right after the dump
    image_digest: str  # image_digest(images): the whole snapshot's identity
    created: float  # time.time() of the install
    pid: int  # the checkpointed parent's pid (a restore recreates it)
    pipes: dict[str, str]  # "stdout"/"stderr"/"control"/"ready" -> CRIU's pipe:[INODE] at the dump
    mapped: tuple[MappedFile, ...]  # files the parent maps, as they were
    preload_s: float = 0.0  # the parent's imports, which a restore saves
    dump_s: float = 0.0

    @property
    def size(self) -> int:
        """The images' bytes."""
        return sum(f.size for f in self.images.values())

    def encode(self) -> bytes:
        return json.dumps(asdict(self), indent=1).encode()

    @classmethod
    def decode(cls, data: bytes) -> Manifest:
        """ValueError (or KeyError/TypeError, wrapped by the caller) when it is not a manifest."""
        obj = json.loads(data)
        return cls(
            key=SnapshotKey.from_wire(obj["key"]),
            images={
                str(n): FileDigest(int(f["size"]), str(f["blake3"])) for n, f in dict(obj["images"]).items()
            },
            image_digest=str(obj["image_digest"]),
            created=float(obj["created"]),
            pid=int(obj["pid"]),
            pipes={str(k): str(v) for k, v in dict(obj["pipes"]).items()},
            mapped=tuple(
                MappedFile(str(m["path"]), int(m["size"]), int(m["mtime_ns"])) for m in obj["mapped"]
            ),
            preload_s=float(obj.get("preload_s", 0.0)),
            dump_s=float(obj.get("dump_s", 0.0)),
        )


@dataclass(frozen=True)
class Found:
    """A snapshot that passed every check of ``lookup``."""

    path: Path  # <store>/<key digest>
    manifest: Manifest

    @property
    def images(self) -> Path:
        return self.path / IMAGES


@dataclass(frozen=True)
class Miss:
    reason: Reason
    detail: str  # for the log line: which fields, which file, which digest


@dataclass
class Usage:
    """The agent's record of one snapshot's use (in .state.json)."""

    restores: int = 0
    last_used: float = 0.0  # time.time() of the last restore reported, else of the install


@dataclass(frozen=True)
class Entry:
    """One installed snapshot as the agent sees it."""

    digest: str  # its key's digest (the directory name)
    bytes: int
    created: float
    usage: Usage = field(default_factory=Usage)


# --- digests ----------------------------------------------------------------------------------------


def is_pages(name: str) -> bool:
    """Whether an image file holds memory pages (the bulk: verified while CRIU restores)."""
    return name.startswith("pages-")


def image_files(
    images: Path, names: Iterable[str] | None = None, workers: int | None = None
) -> dict[str, FileDigest]:
    """Each image file's size and BLAKE3 digest (all of ``images``, or ``names``), files hashed in
    parallel threads (blake3 releases the GIL; one thread per file, so it starts no pool of its own)."""
    if names is None:
        names = sorted(p.name for p in images.iterdir() if p.is_file() and not p.is_symlink())
    names = list(names)
    workers = workers or min(8, os.cpu_count() or 1, max(len(names), 1))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return dict(zip(names, pool.map(lambda name: file_digest(images / name), names), strict=True))


def file_digest(path: Path) -> FileDigest:
    """``path``'s size and BLAKE3 hash, read through a memory map (no copy out of the page cache)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        hasher = blake3.blake3()
        if size:
            with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mapped:
                hasher.update(mapped)
    return FileDigest(size, hasher.hexdigest())


def image_digest(files: dict[str, FileDigest]) -> str:
    """One digest of a whole snapshot's images (what the manifest and the status report)."""
    canonical = json.dumps({name: [f.size, f.blake3] for name, f in sorted(files.items())}).encode()
    return hashlib.sha256(canonical).hexdigest()


def verify_images(images: Path, recorded: dict[str, FileDigest], pages: bool) -> str | None:
    """Check the page files (``pages``) or all the others against ``recorded``: the first
    difference in words, else None. Either way the set of files must be the recorded one."""
    try:
        present = {p.name for p in images.iterdir()}
    except OSError as exc:
        return f"cannot list {images}: {exc}"
    if present != set(recorded):
        missing, extra = sorted(set(recorded) - present), sorted(present - set(recorded))
        return f"{images} lacks {missing or 'nothing'} and has extra {extra or 'nothing'}"
    names = [name for name in sorted(recorded) if is_pages(name) == pages]
    try:
        found = image_files(images, names)
    except OSError as exc:
        return f"cannot read {images}: {exc}"
    for name in names:
        if found[name] != recorded[name]:
            return (
                f"{images / name} hashes to {found[name].blake3[:16]} ({found[name].size} bytes), recorded "
                f"{recorded[name].blake3[:16]} ({recorded[name].size} bytes)"
            )
    return None


def changed_file(mapped: Iterable[MappedFile]) -> str | None:
    """The first mapped file that is not the same here (missing, or another size or mtime), else None."""
    for m in mapped:
        try:
            st = os.stat(m.path)
        except OSError:
            return f"{m.path} is missing"
        if (st.st_size, st.st_mtime_ns) != (m.size, m.mtime_ns):
            return f"{m.path} differs (size {st.st_size} vs {m.size}, mtime {st.st_mtime_ns} vs {m.mtime_ns})"
    return None


# --- the restore's side -----------------------------------------------------------------------------


def read_manifest(path: Path) -> Manifest:
    """The manifest of the snapshot directory ``path``; ValueError naming what is wrong."""
    try:
        with open(path / MANIFEST, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
        if len(data) > MAX_MANIFEST_BYTES:
            raise ValueError(f"larger than {MAX_MANIFEST_BYTES} bytes")
        return Manifest.decode(data)
    except (OSError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path / MANIFEST}: {type(exc).__name__}: {exc}") from None


def snapshot_dirs(root: Path) -> list[Path]:
    """The installed snapshots under ``root`` (not those being taken or removed)."""
    try:
        return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:
        return []


def nearest(root: Path, key: SnapshotKey) -> str:
    """For a miss: the installed snapshot closest to ``key`` and the fields in which it differs."""
    best: tuple[int, str, list[str]] | None = None
    for path in snapshot_dirs(root):
        try:
            fields = differing(read_manifest(path).key, key)
        except ValueError:
            continue
        if best is None or len(fields) < best[0]:
            best = (len(fields), path.name, fields)
    if best is None:
        return "no readable snapshot"
    return f"the nearest snapshot {best[1]} differs in {', '.join(best[2]) or 'nothing (renamed?)'}"


def lookup(root: Path, key: SnapshotKey) -> Found | Miss:
    """The snapshot of ``key`` under ``root`` when every check but the page files' digests passes
    (``verify_pages`` checks those, while CRIU restores), else the Miss saying why."""
    path = root / key.digest()
    if not path.is_dir():
        if not snapshot_dirs(root):
            return Miss(Reason.ABSENT, f"no snapshot in {root}")
        return Miss(Reason.MISMATCH, f"no snapshot for key {key.digest()}; {nearest(root, key)}")
    try:
        manifest = read_manifest(path)
    except ValueError as exc:
        return Miss(Reason.MANIFEST, str(exc))
    if fields := differing(manifest.key, key):
        return Miss(Reason.MISMATCH, f"{path} holds another key (fields {', '.join(fields)})")
    if image_digest(manifest.images) != manifest.image_digest:
        return Miss(Reason.MANIFEST, f"{path / MANIFEST}: its files do not add up to its image digest")
    if (change := changed_file(manifest.mapped)) is not None:
        return Miss(Reason.FILES, change)
    if (wrong := verify_images(path / IMAGES, manifest.images, pages=False)) is not None:
        return Miss(Reason.DIGEST, wrong)
    return Found(path, manifest)


def verify_pages(found: Found) -> Miss | None:
    """The page files' digests (the bulk of a snapshot), checked before the restored parent is
    handed its context: None when they match."""
    wrong = verify_images(found.images, found.manifest.images, pages=True)
    return None if wrong is None else Miss(Reason.DIGEST, wrong)


def verify_installed(root: Path, digest: str) -> str | None:
    """Why the installed snapshot ``digest`` does not hold up here, every check and every byte
    (the agent's own view: its files, its key), or None when it does."""
    try:
        manifest = read_manifest(root / digest)
    except ValueError as exc:
        return str(exc)
    if manifest.key.digest() != digest:
        return f"{root / digest} holds key {manifest.key.digest()}"
    found = lookup(root, manifest.key)
    if isinstance(found, Miss):
        return found.detail
    wrong = verify_pages(found)
    return None if wrong is None else wrong.detail


# --- the agent's side -------------------------------------------------------------------------------


def plan_eviction(entries: Iterable[Entry], incoming: int, budget: int | None) -> list[str] | None:
    """The snapshots to remove (least recently used first) so that ``incoming`` more bytes fit the
    budget; None when it cannot fit even alone. Pure."""
    if budget is None:
        return []
    if incoming > budget:
        return None
    ordered = sorted(entries, key=lambda e: (e.usage.last_used or e.created, e.digest))
    total = sum(e.bytes for e in ordered) + incoming
    evict = []
    for entry in ordered:
        if total <= budget:
            break
        evict.append(entry.digest)
        total -= entry.bytes
    return evict


class Store:
    """The agent's handle on the store: install, remove, usage. Only the agent (root) writes."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def prepare(self) -> None:
        """Create the root (0755, the agent's), drop leftovers of interrupted takes and removals."""
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)
        for path in self.root.iterdir():
            if path.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
                shutil.rmtree(path, ignore_errors=True)

    def temp_dir(self, digest: str) -> Path:
        """A fresh directory for a snapshot being taken."""
        for n in range(1000):
            path = self.root / f"{TMP_PREFIX}{digest}-{os.getpid()}-{n}"
            try:
                path.mkdir(mode=0o700)
                return path
            except FileExistsError:
                continue
        raise OSError(f"no free temporary directory name under {self.root}")

    def install(self, temp: Path, manifest: Manifest, gid: int) -> Path:
        """Seal ``temp`` (owned by root, readable by ``gid`` only, read-only, synced), write its
        manifest and rename it into place. FileExistsError when another install won the race."""
        final = self.root / manifest.key.digest()
        for dirpath, dirnames, filenames in os.walk(temp):
            for name in filenames:
                path = os.path.join(dirpath, name)
                os.chown(path, 0, gid, follow_symlinks=False)
                os.chmod(path, 0o440)
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
            for name in dirnames:
                os.chown(os.path.join(dirpath, name), 0, gid)
                os.chmod(os.path.join(dirpath, name), 0o550)
        manifest_path = temp / MANIFEST
        with open(manifest_path, "wb") as f:
            f.write(manifest.encode())
            f.flush()
            os.fsync(f.fileno())
        os.chown(manifest_path, 0, gid)
        os.chmod(manifest_path, 0o440)
        os.chown(temp, 0, gid)
        os.chmod(temp, 0o550)
        if final.exists():
            raise FileExistsError(final)
        os.rename(temp, final)
        _fsync_dir(self.root)
        self._touch(final.name, time.time(), restored=False)
        return final

    def remove(self, digest: str) -> None:
        """Remove one snapshot: renamed out of sight first, so no reader sees half of it."""
        path = self.root / digest
        trash = self.root / f"{TRASH_PREFIX}{digest}-{time.monotonic_ns()}"
        with contextlib.suppress(FileNotFoundError):
            os.rename(path, trash)
            shutil.rmtree(trash, ignore_errors=True)
        state = self._state()
        if state.pop(digest, None) is not None:
            self._write_state(state)

    def entries(self) -> list[Entry]:
        """Every installed snapshot with its usage (unreadable manifests are skipped)."""
        state = self._state()
        out = []
        for path in snapshot_dirs(self.root):
            try:
                manifest = read_manifest(path)
            except ValueError:
                continue
            out.append(Entry(path.name, manifest.size, manifest.created, state.get(path.name, Usage())))
        return out

    def note_restore(self, digest: str) -> bool:
        """Count one restore of ``digest`` (reported by a pod); False when no such snapshot."""
        if not (self.root / digest).is_dir():
            return False
        self._touch(digest, time.time(), restored=True)
        return True

    def _touch(self, digest: str, when: float, restored: bool) -> None:
        state = self._state()
        usage = state.setdefault(digest, Usage())
        usage.last_used = when
        usage.restores += int(restored)
        self._write_state(state)

    def _state(self) -> dict[str, Usage]:
        try:
            raw = json.loads((self.root / STATE).read_text())
            return {str(k): Usage(int(v["restores"]), float(v["last_used"])) for k, v in raw.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return {}

    def _write_state(self, state: dict[str, Usage]) -> None:
        temp = self.root / f"{STATE}.tmp"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({k: asdict(v) for k, v in state.items()}, f)
        os.replace(temp, self.root / STATE)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
