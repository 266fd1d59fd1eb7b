"""audio_url allow-lists (server/base/media_fetch.py) against a real HTTP server on loopback and real files:
what is fetched, and every way an attacker could try to get more."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from keepwarm_runtime.server.base.errors import APIError
from keepwarm_runtime.server.base.media_fetch import MediaPolicy, fetch_media, media_policy, parse_domains
from tests.integration.audio.media_server import MediaServer

PAYLOAD = b"RIFF" + bytes(range(256)) * 8
CAP = 64 * 1024


@pytest.fixture(scope="module")
def media() -> MediaServer:
    with MediaServer(PAYLOAD, big_bytes=4 * CAP) as server:
        yield server


def _policy(**kw: object) -> MediaPolicy:
    return MediaPolicy(**({"domains": frozenset({"127.0.0.1"}), "max_bytes": CAP, "timeout_s": 5.0} | kw))


def _refusal(url: str, policy: MediaPolicy) -> APIError:
    with pytest.raises(APIError) as info:
        asyncio.run(fetch_media(url, policy, "messages.0.content.0"))
    assert info.value.param == "messages.0.content.0"
    return info.value


def test_allowed_host_is_fetched_with_same_origin_redirects(media: MediaServer) -> None:
    assert asyncio.run(fetch_media(media.url("/audio"), _policy(), "p")) == PAYLOAD
    assert asyncio.run(fetch_media(media.url("/same-origin"), _policy(), "p")) == PAYLOAD


def test_hosts_off_the_list_are_never_contacted(media: MediaServer) -> None:
    before = media.hits["/audio"]
    error = _refusal(media.url("/audio"), MediaPolicy())  # the default: nothing is fetched
    assert (error.status, error.code) == (400, "media_url_not_allowed")
    assert "--allowed-media-domains" in error.message
    error = _refusal(media.url("/audio", host="localhost"), _policy())
    assert error.code == "media_url_not_allowed"
    # userinfo that looks like the allowed host does not make another host allowed
    assert (
        _refusal(f"http://127.0.0.1@localhost:{media.port}/audio", _policy()).code == "media_url_not_allowed"
    )
    assert media.hits["/audio"] == before


def test_redirect_to_another_host_is_refused_before_it_is_followed(media: MediaServer) -> None:
    before = media.hits["/audio"]
    error = _refusal(media.url("/other-origin"), _policy())
    assert (error.status, error.code) == (400, "media_redirect_refused")
    assert media.hits["/audio"] == before
    assert _refusal(media.url("/loop"), _policy()).code == "media_fetch_failed"


def test_too_large_is_413_declared_or_not(media: MediaServer) -> None:
    for path in ("/big", "/undeclared"):
        error = _refusal(media.url(path), _policy())
        assert (error.status, error.code) == (413, "audio_too_large")


def test_slow_host_times_out_and_missing_is_named(media: MediaServer) -> None:
    error = _refusal(media.url("/slow"), _policy(timeout_s=0.5))
    assert (error.status, error.code) == (400, "media_fetch_timeout")
    error = _refusal(media.url("/missing"), _policy())
    assert (error.code, "HTTP 404" in error.message) == ("media_fetch_failed", True)
    error = _refusal(f"http://127.0.0.1:{_closed_port()}/audio", _policy())
    assert error.code == "media_fetch_failed"


def _closed_port() -> int:
    from keepwarm_runtime.server.launcher import free_port

    return free_port()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "a b.wav").write_bytes(PAYLOAD)
    (tmp_path / "secret.wav").write_bytes(b"secret")
    (allowed / "escape.wav").symlink_to(tmp_path / "secret.wav")
    (allowed / "inside.wav").symlink_to(allowed / "a b.wav")
    (allowed / "big.wav").write_bytes(b"\0" * (CAP + 1))
    os.mkfifo(allowed / "pipe.wav")
    (allowed / "loop.wav").symlink_to(allowed / "loop.wav")
    return allowed


def test_local_files_inside_the_root_are_read(root: Path) -> None:
    policy = _policy(local_root=root)
    assert asyncio.run(fetch_media((root / "a b.wav").as_uri(), policy, "p")) == PAYLOAD
    assert asyncio.run(fetch_media((root / "inside.wav").as_uri(), policy, "p")) == PAYLOAD


@pytest.mark.parametrize(
    ("name", "status", "code"),
    [
        ("../secret.wav", 400, "media_url_not_allowed"),  # traversal
        ("%2e%2e/secret.wav", 400, "media_url_not_allowed"),  # encoded traversal
        ("escape.wav", 400, "media_url_not_allowed"),  # symlink out of the root
        ("pipe.wav", 400, "invalid_media_url"),  # a FIFO would block the reader
        ("nothing.wav", 400, "media_not_found"),
        ("big.wav", 413, "audio_too_large"),
        ("loop.wav", 400, "invalid_media_url"),  # a symlink to itself
        ("a%00b.wav", 400, "invalid_media_url"),  # a NUL byte
    ],
)
def test_local_attacks_are_refused(root: Path, name: str, status: int, code: str) -> None:
    error = _refusal(f"file://{root}/{name}", _policy(local_root=root))
    assert (error.status, error.code) == (status, code)
    assert "secret" not in error.message


def test_local_paths_need_the_flag_and_a_local_url(root: Path) -> None:
    assert _refusal((root / "a b.wav").as_uri(), _policy()).code == "media_url_not_allowed"
    assert _refusal(f"file://otherhost{root}/a%20b.wav", _policy(local_root=root)).code == "invalid_media_url"
    assert _refusal(str(root / "a b.wav"), _policy(local_root=root)).code == "invalid_media_url"
    assert _refusal("ftp://127.0.0.1/a.wav", _policy()).code == "invalid_media_url"


def test_start_up_checks(tmp_path: Path) -> None:
    assert parse_domains(" Media.Example.com, 127.0.0.1 ,") == {"media.example.com", "127.0.0.1"}
    assert parse_domains(None) == frozenset()
    for bad in ("https://a.example", "*.example.com", "a.example:443", "a.example/x"):
        with pytest.raises(ValueError, match="not a host name"):
            parse_domains(bad)
    with pytest.raises(ValueError, match="not a directory"):
        media_policy(None, str(tmp_path / "absent"))
    with pytest.raises(ValueError, match="--media-fetch-timeout"):
        media_policy(None, None, timeout_s=0)
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    assert media_policy("x.example", str(link)).local_root == tmp_path.resolve()
