"""Socket dir modes, symlink/foreign-owner refusal, the daemon lock and peer policy, on real files."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from keepwarm_runtime.cache import security

NOBODY = 65534


def test_socket_dir_is_private(tmp_path: Path):
    path = security.prepare_socket_dir(tmp_path / "a" / "wc")
    assert stat.S_IMODE(os.lstat(path).st_mode) == 0o700


def test_socket_dir_with_group(tmp_path: Path):
    path = security.prepare_socket_dir(tmp_path / "wc", gid=NOBODY)
    st = os.lstat(path)
    assert stat.S_IMODE(st.st_mode) == 0o770
    assert st.st_gid == NOBODY


def test_existing_loose_dir_is_tightened(tmp_path: Path):
    (tmp_path / "wc").mkdir(mode=0o777)
    os.chmod(tmp_path / "wc", 0o777)
    security.prepare_socket_dir(tmp_path / "wc")
    assert stat.S_IMODE(os.lstat(tmp_path / "wc").st_mode) == 0o700


def test_symlinked_socket_dir_refused(tmp_path: Path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(security.CacheSecurityError, match="symlink"):
        security.prepare_socket_dir(tmp_path / "link")


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_foreign_owned_socket_dir_refused(tmp_path: Path):
    (tmp_path / "wc").mkdir()
    os.chown(tmp_path / "wc", NOBODY, -1)
    with pytest.raises(security.CacheSecurityError, match="owned by uid"):
        security.prepare_socket_dir(tmp_path / "wc")


def test_second_lock_holder_refused(tmp_path: Path):
    first = security.DaemonLock(tmp_path / "host.sock")
    first.acquire()
    second = security.DaemonLock(tmp_path / "host.sock")
    with pytest.raises(security.DaemonAlreadyRunning, match=f"pid {os.getpid()}"):
        second.acquire()
    first.release()
    second.acquire()  # free again once released
    second.release()


def test_only_lock_holder_removes_stale_socket(tmp_path: Path):
    path = tmp_path / "host.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()  # a stale socket file, as a killed daemon leaves it
    lock = security.DaemonLock(path)
    with pytest.raises(security.CacheSecurityError, match="not held"):
        security.remove_stale_socket(path, lock)
    lock.acquire()
    security.remove_stale_socket(path, lock)
    assert not path.exists()
    lock.release()


def test_non_socket_in_the_way_is_not_removed(tmp_path: Path):
    path = tmp_path / "host.sock"
    path.write_text("precious")
    lock = security.DaemonLock(path)
    lock.acquire()
    with pytest.raises(security.CacheSecurityError, match="not a socket"):
        security.remove_stale_socket(path, lock)
    assert path.read_text() == "precious"
    lock.release()


def test_client_refuses_symlinked_socket(tmp_path: Path):
    real = tmp_path / "real.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(real))
    (tmp_path / "host.sock").symlink_to(real)
    with pytest.raises(security.CacheSecurityError, match="symlink"):
        security.check_client_path(tmp_path / "host.sock")
    s.close()


def test_peer_policy():
    policy = security.PeerPolicy(uid=0, allow_uids=frozenset({1000}), allow_gids=frozenset({2000}))
    cred = security.PeerCred
    assert policy.allows(cred(1, 0, 0))
    assert policy.allows(cred(1, 1000, 5))
    assert policy.allows(cred(1, 5, 2000))
    assert not policy.allows(cred(1, NOBODY, NOBODY))
    assert policy.allows(cred(1, NOBODY, NOBODY, frozenset({7, 2000})))  # a supplementary group
    assert not policy.allows(cred(1, NOBODY, NOBODY, frozenset({7})))
    assert "SO_PEERGROUPS" in policy.refusal(cred(1, NOBODY, NOBODY, None))
    assert "[7, 65534]" in policy.refusal(cred(1, NOBODY, NOBODY, frozenset({7})))


def test_peer_cred_of_socketpair():
    a, b = socket.socketpair()
    cred = security.peer_cred(a, with_groups=True)
    assert (cred.pid, cred.uid) == (os.getpid(), os.geteuid())
    assert cred.groups == frozenset(os.getgroups())  # SO_PEERGROUPS: Linux >= 4.13
    a.close()
    b.close()


def test_trusted_owners_are_this_uid_root_and_the_ones_named():
    assert security.trusted_owners() == {0, os.geteuid()}
    assert security.trusted_owners(frozenset({5, 6})) == {0, os.geteuid(), 5, 6}


@pytest.mark.skipif(os.geteuid() != 0, reason="a socket owned by another uid needs root to make")
def test_client_trusts_another_owner_only_when_the_caller_names_it(tmp_path: Path, monkeypatch):
    """--cache-trusted-uid reaches the check as an argument; the variable is not read here."""
    directory = tmp_path / "wc"
    directory.mkdir()
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(directory / "host.sock"))
    os.chown(directory, NOBODY, -1)
    os.chown(directory / "host.sock", NOBODY, -1)
    monkeypatch.setenv("KEEPWARM_CACHE_TRUSTED_UIDS", str(NOBODY))
    with pytest.raises(security.CacheSecurityError, match=f"owned by uid {NOBODY}"):
        security.check_client_path(directory / "host.sock")
    security.check_client_path(directory / "host.sock", frozenset({NOBODY}))
    listener.close()
