"""Who may talk to the cache: socket directory and file modes, peer credentials, the daemon lock.

The socket hands out fds that map model weights, so the directory is private (0700, or 0770 with
a shared group for pods of other users, since hostPath ignores fsGroup), the daemon checks every
peer's uid and groups (SO_PEERCRED for the primary gid, SO_PEERGROUPS for the supplementary ones:
Kubernetes hands pods the socket's group through ``supplementalGroups``), and a client only trusts a
socket owned by itself, root, or a uid its caller names (``trusted_uids``: `keepwarm serve`'s
``--cache-trusted-uid``, resolved by the settings layer; nothing here reads the environment).
"""

from __future__ import annotations

import ctypes
import datetime as dt
import errno
import fcntl
import grp
import os
import socket
import stat
import struct
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from keepwarm_api.refusals import Refusals, record
from keepwarm_api.sockets import MAX_SOCKET_PATH_BYTES


class CacheSecurityError(Exception):
    """A path or peer failed a check; the message says which and how to fix it."""


class DaemonAlreadyRunning(CacheSecurityError):
    """Another daemon holds the socket's lock file."""


SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux >= 4.13; Python may not name it
_GID_SIZE = 4  # gid_t


@dataclass(frozen=True)
class PeerCred:
    pid: int
    uid: int
    gid: int  # primary gid
    groups: frozenset[int] | None = None  # supplementary gids; None where the kernel cannot say


@dataclass(frozen=True)
class PeerPolicy:
    uid: int = field(default_factory=os.geteuid)  # the daemon's own uid: always allowed
    allow_uids: frozenset[int] = frozenset()  # --allow-uid
    allow_gids: frozenset[int] = frozenset()  # --allow-gid

    def allows(self, cred: PeerCred) -> bool:
        """Own uid, an allowed uid, or an allowed gid among the primary and supplementary groups."""
        gids = {cred.gid} | set(cred.groups or ())
        return cred.uid == self.uid or cred.uid in self.allow_uids or bool(gids & self.allow_gids)

    def refusal(self, cred: PeerCred) -> str:
        """Why ``cred`` is refused, in words an operator can act on."""
        if cred.groups is None:
            groups = f"gid {cred.gid} (supplementary groups unknown: SO_PEERGROUPS needs Linux >= 4.13)"
        else:
            groups = f"gids {sorted({cred.gid} | cred.groups)}"
        return (
            f"uid {cred.uid} with {groups} is not allowed; start the daemon with --allow-uid or --allow-gid"
        )


class RefusalLog:
    """The latest episode of refused peers, for the node agent to report (as PeersRefused): a pod
    refused here falls back to disk, and its user looks at the WeightCacheNode, not this log."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latest: Refusals | None = None

    def record(self, reason: str, at: dt.datetime | None = None) -> None:
        at = at or dt.datetime.now(dt.UTC)
        with self._lock:
            self._latest = record(self._latest, reason, at)

    def latest(self) -> Refusals | None:
        with self._lock:
            return self._latest


def _peer_groups_ctypes(sock: socket.socket, count: int) -> bytes:
    """getsockopt with a buffer larger than Python's 1024-byte limit (peers in > 256 groups)."""
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(count * _GID_SIZE)
    size = ctypes.c_uint32(len(buf))
    if libc.getsockopt(sock.fileno(), socket.SOL_SOCKET, SO_PEERGROUPS, buf, ctypes.byref(size)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return buf.raw[: size.value]


def peer_groups(sock: socket.socket) -> frozenset[int] | None:
    """Supplementary gids of the peer (as of connect), or None on kernels without SO_PEERGROUPS."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 1024)
    except OSError as exc:
        if exc.errno == errno.ERANGE:
            raw = _peer_groups_ctypes(sock, 65536)
        elif exc.errno in (errno.ENOPROTOOPT, errno.EINVAL, errno.EOPNOTSUPP):
            return None
        else:
            raise
    n = len(raw) // _GID_SIZE
    return frozenset(struct.unpack(f"{n}I", raw[: n * _GID_SIZE]))


def peer_cred(sock: socket.socket, with_groups: bool = False) -> PeerCred:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return PeerCred(pid, uid, gid, peer_groups(sock) if with_groups else None)


def resolve_gid(group: str | int | None) -> int | None:
    if group is None:
        return None
    if isinstance(group, int) or str(group).isdigit():
        return int(group)
    try:
        return grp.getgrnam(str(group)).gr_gid
    except KeyError:
        raise CacheSecurityError(f"group {group!r} does not exist on this node") from None


def _check_owned(path: Path, st: os.stat_result, what: str, trusted: set[int]) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise CacheSecurityError(f"{what} {path} is a symlink; refusing (point at the real directory)")
    if st.st_uid not in trusted:
        raise CacheSecurityError(
            f"{what} {path} is owned by uid {st.st_uid}, not by uid(s) {sorted(trusted)}; refusing"
        )


def prepare_socket_dir(path: str | Path, gid: int | None = None) -> Path:
    """Create (or check) the daemon's socket directory: ours, not a symlink, 0700 or 0770+group."""
    path = Path(path)
    mode = 0o770 if gid is not None else 0o700
    try:
        os.makedirs(path.parent, mode=0o755, exist_ok=True)
        os.mkdir(path, mode)
    except FileExistsError:
        pass
    st = os.lstat(path)
    _check_owned(path, st, "socket directory", {os.geteuid()})
    if not stat.S_ISDIR(st.st_mode):
        raise CacheSecurityError(f"socket directory {path} is not a directory")
    if gid is not None and st.st_gid != gid:
        os.chown(path, -1, gid)
    os.chmod(path, mode)
    return path


def check_socket_path(path: Path) -> None:
    """Refuse a socket path bind() would refuse, naming it: the per-GPU socket name carries the GPU's
    UUID (~50 bytes), so a deep socket directory can fit every file but the socket."""
    length = len(os.fsencode(path))
    if length > MAX_SOCKET_PATH_BYTES:
        raise ValueError(
            f"socket path {path} is {length} bytes; AF_UNIX allows {MAX_SOCKET_PATH_BYTES}: "
            "choose a shorter socket directory"
        )


def bind_private(path: Path, lock: DaemonLock) -> socket.socket:
    """A Unix socket bound at `path` (a stale one of a dead holder of `lock` removed first), created
    0600 under a private umask so no other uid ever sees it open, even for an instant."""
    remove_stale_socket(path, lock)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        listener.bind(str(path))
    finally:
        os.umask(old_umask)
    return listener


class DaemonLock:
    """Exclusive flock on ``<socket>.lock``: one daemon per socket; only its holder may unlink."""

    def __init__(self, socket_path: Path) -> None:
        self.path = Path(f"{socket_path}.lock")
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise DaemonAlreadyRunning(
                    f"another keepwarm cache daemon (pid {holder}) holds {self.path}; stop it or use "
                    "another --socket-dir"
                ) from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def adopt(self, fd: int) -> None:
        """Hold the lock through ``fd``, a predecessor's descriptor of it (one open file description:
        the flock is never free between the two daemons); the file then names this pid."""
        self.release()
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    @property
    def fd(self) -> int | None:
        return self._fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None


def remove_stale_socket(socket_path: Path, lock: DaemonLock) -> None:
    """Unlink a socket left by a dead daemon; only the lock holder may do this."""
    if not lock.held:
        raise CacheSecurityError(f"refusing to remove {socket_path}: lock {lock.path} is not held")
    try:
        st = os.lstat(socket_path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise CacheSecurityError(f"{socket_path} exists and is not a socket; remove it by hand")
    os.unlink(socket_path)


def secure_socket_file(socket_path: Path, gid: int | None) -> None:
    if gid is not None:
        os.chown(socket_path, -1, gid)
    os.chmod(socket_path, 0o660 if gid is not None else 0o600)


def trusted_owners(trusted_uids: Iterable[int] = ()) -> set[int]:
    """Uids a client trusts to own a daemon socket: itself, root, and ``trusted_uids``."""
    return {0, os.geteuid(), *trusted_uids}


def check_client_path(socket_path: Path, trusted_uids: Iterable[int] = ()) -> None:
    """Client side: the directory and socket are real (no symlinks) and owned by a trusted uid."""
    trusted = trusted_owners(trusted_uids)
    st_dir = os.lstat(socket_path.parent)
    _check_owned(socket_path.parent, st_dir, "socket directory", trusted)
    st = os.lstat(socket_path)
    _check_owned(socket_path, st, "socket", trusted)
    if not stat.S_ISSOCK(st.st_mode):
        raise CacheSecurityError(f"{socket_path} is not a socket")


def check_server_peer(sock: socket.socket, trusted_uids: Iterable[int] = ()) -> PeerCred:
    """Client side: the process behind the socket runs as a trusted uid."""
    cred = peer_cred(sock)
    if cred.uid not in trusted_owners(trusted_uids):
        raise CacheSecurityError(f"daemon behind the socket runs as uid {cred.uid}, which is not trusted")
    return cred
