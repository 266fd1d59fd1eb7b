"""The client honours or refuses by name every field of a daemon's reply (a fake daemon on a real socket),
and reads KEEPWARM_CACHE_* with the one empty-means-default rule."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest
import torch

from keepwarm_api.settings import SettingError
from keepwarm_runtime.cache import protocol
from keepwarm_runtime.cache.client import CacheAttachError, attach
from keepwarm_runtime.cache.env import CacheClientSettings, cache_client_settings, env_flag, env_text


@pytest.fixture
def model(tmp_path: Path) -> Path:
    from safetensors.torch import save_file

    (tmp_path / "m").mkdir()
    save_file({"w": torch.arange(16, dtype=torch.float32).view(4, 4)}, tmp_path / "m" / "model.safetensors")
    return tmp_path / "m"


def fake_daemon(socket_dir: Path, hit: dict) -> socket.socket:
    """Answers hello, then a get_state with ``hit`` (merged over a valid hit) and a real memfd."""
    socket_dir.mkdir(mode=0o700)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(socket_dir / "host.sock"))
    listener.listen(4)
    fd = os.memfd_create("keepwarm:fake")
    os.write(fd, torch.arange(16, dtype=torch.float32).numpy().tobytes())
    os.ftruncate(fd, 4096)
    valid = {
        "ok": True,
        "state": "hit",
        "model": "m",
        "tier": "host",
        "size": 4096,
        "page_mode": "4k",
        "gpu_uuid": None,
        "digest": "d",
        "tensors": [["w", "float32", [4, 4], 0, 64]],
        "aliases": {},
    }

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                protocol.recv_frame(conn)
                protocol.send_frame(conn, {"ok": True, "protocol": protocol.PROTOCOL_VERSION})
                protocol.recv_frame(conn)
                protocol.send_frame(conn, valid | hit, [fd])

    threading.Thread(target=serve, daemon=True).start()
    return listener


@pytest.mark.parametrize(
    ("hit", "message"),
    [
        ({"page_mode": "giant"}, "page_mode"),
        ({"gpu_uuid": "GPU-1234"}, "gpu_uuid"),
        ({"tier": "disk"}, "tier"),
        ({"aliases": {"lm_head.weight": "missing"}}, "aliases"),
        ({"aliases": ["w"]}, "aliases"),
        ({"tensors": [["w", "float32", [4, 4], 4090, 64]]}, "does not fit"),
        ({"tensors": [["w", "float32", [4, 4], 0, 60]]}, "does not fit"),
    ],
)
def test_bad_replies_are_refused_by_name(tmp_path, model, hit, message):
    listener = fake_daemon(tmp_path / "wc", hit)
    try:
        with pytest.raises(CacheAttachError, match=message) as info:
            attach(model, tmp_path / "wc", dtype=torch.float32, fallback=False)
        assert info.value.reason == "error: bad_reply"
        assert attach(model, tmp_path / "wc", dtype=torch.float32).source == "disk"
    finally:
        listener.close()


def test_good_reply_is_honoured(tmp_path, model):
    listener = fake_daemon(tmp_path / "wc", {"aliases": {"lm_head.weight": "w"}, "page_mode": "thp"})
    try:
        res = attach(model, tmp_path / "wc", dtype=torch.float32, fallback=False)
    finally:
        listener.close()
    assert (res.source, res.aliases, res.page_mode, res.gpu_uuid) == (
        "cache",
        {"lm_head.weight": "w"},
        "thp",
        None,
    )
    assert torch.equal(res.tensors["w"], torch.arange(16, dtype=torch.float32).view(4, 4))


def test_env_rule_empty_means_default():
    assert env_flag("X", True, {}) is True
    assert env_flag("X", True, {"X": ""}) is True
    assert env_flag("X", False, {"X": "  "}) is False
    assert env_flag("X", True, {"X": "off"}) is False and env_flag("X", False, {"X": "YES"}) is True
    with pytest.raises(ValueError, match="X='maybe'"):
        env_flag("X", True, {"X": "maybe"})
    assert env_text("X", "zero_copy", {"X": ""}) == "zero_copy"


def test_cache_client_settings_read_the_variables_by_the_one_rule(tmp_path, model):
    """The KEEPWARM_CACHE_* variables, for a caller without settings; attach() takes what they say."""
    env = {
        "KEEPWARM_CACHE_SOCKET_DIR": str(tmp_path / "no-daemon"),
        "KEEPWARM_CACHE_FALLBACK": "",
        "KEEPWARM_CACHE_MODE": "",
    }
    assert cache_client_settings({}) == CacheClientSettings() == CacheClientSettings(None, "zero_copy", True)
    settings = cache_client_settings(env)
    assert settings == CacheClientSettings(str(tmp_path / "no-daemon"), "zero_copy", True)  # empty: default
    res = attach(
        model, settings.socket_dir, dtype=torch.float32, mode=settings.mode, fallback=settings.fallback
    )
    assert res.source == "disk"  # fallback on: the default
    settings = cache_client_settings(
        env | {"KEEPWARM_CACHE_FALLBACK": "false", "KEEPWARM_CACHE_MODE": "copy"}
    )
    assert (settings.mode, settings.fallback) == ("copy", False)
    with pytest.raises(CacheAttachError):
        attach(model, settings.socket_dir, dtype=torch.float32, fallback=settings.fallback)
    with pytest.raises(ValueError, match="KEEPWARM_CACHE_FALLBACK"):
        cache_client_settings(env | {"KEEPWARM_CACHE_FALLBACK": "perhaps"})
    assert cache_client_settings(env | {"KEEPWARM_CACHE_TRUSTED_UIDS": "1000, 1001"}).trusted_uids == {
        1000,
        1001,
    }
    with pytest.raises(SettingError, match="KEEPWARM_CACHE_TRUSTED_UIDS='1000 1001' is not valid"):
        cache_client_settings(env | {"KEEPWARM_CACHE_TRUSTED_UIDS": "1000 1001"})


def test_attach_reads_no_environment(tmp_path, model, monkeypatch):
    """Only its arguments count: variables that would send it to a missing daemon, without fallback,
    change nothing."""
    monkeypatch.setenv("KEEPWARM_CACHE_SOCKET_DIR", str(tmp_path / "no-daemon"))
    monkeypatch.setenv("KEEPWARM_CACHE_FALLBACK", "false")
    monkeypatch.setenv("KEEPWARM_CACHE_MODE", "bogus")
    assert attach(model, None, dtype=torch.float32).source == "disk"
