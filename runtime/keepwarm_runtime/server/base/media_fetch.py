"""Audio by reference: ``audio_url`` http(s) and ``file:`` URLs, each read only where an allow-list names it.

Both lists are off by default, and then this server never fetches media. ``--allowed-media-domains``
names the hosts whose http(s) URLs may be fetched (exact host names, no wildcards: a pattern is one
more thing an attacker can aim at; names resolve as usual, so where they point is the operator's
choice); ``--allowed-local-media-path`` names one directory whose files
``file:`` URLs may read. Why each guard is there:

- a remote fetch is async (httpx) under one overall deadline, so a slow or trickling host costs its
  own request a timeout and never the event loop or the other requests;
- redirects are followed by hand and only within the same origin (scheme, host, port): a redirect is
  the classic way around a host allow-list;
- bytes are counted while they stream in, so a missing or lying Content-Length (or a compressed body
  that inflates) cannot get past the byte cap;
- a local path is resolved (``..`` and symlinks) before the prefix check, opened without following a
  final symlink, and must be a regular file: a FIFO would block and /dev/zero never ends.
"""

from __future__ import annotations

import asyncio
import os
import stat
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from keepwarm_runtime.server.base.errors import BadRequest, PayloadTooLarge
from keepwarm_runtime.server.base.limits import DEFAULT_FETCH_TIMEOUT_S, DEFAULT_MAX_MEDIA_BYTES

MAX_REDIRECTS = 3
REMOTE_SCHEMES = ("http", "https")
LOCAL_SCHEME = "file"


@dataclass(frozen=True)
class MediaPolicy:
    """Where ``audio_url`` may point; the empty default refuses every reference but ``data:``."""

    domains: frozenset[str] = field(default_factory=frozenset)  # lower-case host names
    local_root: Path | None = None  # resolved directory, or None: file: URLs refused
    max_bytes: int = DEFAULT_MAX_MEDIA_BYTES
    timeout_s: float = DEFAULT_FETCH_TIMEOUT_S


def parse_domains(text: str | None) -> frozenset[str]:
    """``host1,host2`` -> the set of host names; ValueError for anything that is not a bare host."""
    hosts = frozenset(h.strip().lower() for h in (text or "").split(",") if h.strip())
    for host in hosts:
        if any(c in host for c in "/:*@?# ") and not _is_ipv6(host):
            raise ValueError(
                f"--allowed-media-domains: {host!r} is not a host name (give hosts like "
                "media.example.com, without scheme, port, path or wildcards)"
            )
    return hosts


def _is_ipv6(host: str) -> bool:
    return ":" in host and all(c in "0123456789abcdef:." for c in host)


def local_root(text: str | None) -> Path | None:
    """The resolved directory of ``--allowed-local-media-path``; ValueError when it is not one."""
    if not text:
        return None
    root = Path(text).resolve()
    if not root.is_dir():
        raise ValueError(f"--allowed-local-media-path: {text} is not a directory")
    return root


def media_policy(
    domains: str | None,
    local_path: str | None,
    max_bytes: int = DEFAULT_MAX_MEDIA_BYTES,
    timeout_s: float = DEFAULT_FETCH_TIMEOUT_S,
) -> MediaPolicy:
    """Start-up checks of the allow-list flags (ValueError names the bad one)."""
    if timeout_s <= 0:
        raise ValueError(f"--media-fetch-timeout must be positive (got {timeout_s:g})")
    return MediaPolicy(parse_domains(domains), local_root(local_path), max_bytes, timeout_s)


async def fetch_media(url: str, policy: MediaPolicy, where: str) -> bytes:
    """The bytes ``url`` names (http, https or file), or a named refusal (400, 413 when too large)."""
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme in REMOTE_SCHEMES:
        return await _fetch_remote(url, policy, where)
    if scheme == LOCAL_SCHEME:
        return await asyncio.to_thread(read_local, url, policy, where)
    raise BadRequest(
        "audio_url must be a data:, http(s): or file: URL (remote URLs and local paths only where "
        "the server's allow-list names them)",
        param=where,
        code="invalid_media_url",
    )


def _too_large(policy: MediaPolicy, where: str) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"the audio at audio_url is over the limit of {policy.max_bytes} bytes",
        param=where,
        code="audio_too_large",
    )


def check_remote(url: str, policy: MediaPolicy, where: str) -> None:
    """400 unless ``url``'s host is on the allow-list."""
    try:
        host = httpx.URL(url).host.lower()
    except httpx.InvalidURL as exc:
        raise BadRequest(
            f"audio_url is not a valid URL: {exc}", param=where, code="invalid_media_url"
        ) from exc
    if host not in policy.domains:
        raise BadRequest(
            f"audio_url host {host!r} is not allowed: remote URLs are refused unless "
            "--allowed-media-domains names the host",
            param=where,
            code="media_url_not_allowed",
        )


async def _fetch_remote(url: str, policy: MediaPolicy, where: str) -> bytes:
    check_remote(url, policy, where)
    try:
        async with asyncio.timeout(policy.timeout_s):
            return await _follow(httpx.URL(url), policy, where)
    except TimeoutError:
        raise BadRequest(
            f"fetching audio_url took longer than {policy.timeout_s:g} s",
            param=where,
            code="media_fetch_timeout",
        ) from None
    except (httpx.HTTPError, httpx.InvalidURL) as exc:  # InvalidURL: a redirect to a malformed URL
        raise BadRequest(
            f"cannot fetch audio_url: {type(exc).__name__}: {exc}", param=where, code="media_fetch_failed"
        ) from exc


async def _follow(url: httpx.URL, policy: MediaPolicy, where: str) -> bytes:
    """GET with same-origin redirects only, the body capped at ``policy.max_bytes`` as it streams."""
    # trust_env off: proxy variables in the pod must not reroute (or leak) an allow-listed fetch.
    async with httpx.AsyncClient(follow_redirects=False, trust_env=False, timeout=policy.timeout_s) as client:
        for _ in range(MAX_REDIRECTS + 1):
            async with client.stream("GET", url) as response:
                if response.is_redirect:
                    url = _redirect_target(url, response.headers.get("location", ""), where)
                    continue
                if response.status_code != 200:
                    raise BadRequest(
                        f"fetching audio_url answered HTTP {response.status_code}",
                        param=where,
                        code="media_fetch_failed",
                    )
                declared = response.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > policy.max_bytes:
                    raise _too_large(policy, where)
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > policy.max_bytes:
                        raise _too_large(policy, where)
                return bytes(body)
    raise BadRequest(
        f"audio_url redirected more than {MAX_REDIRECTS} times", param=where, code="media_fetch_failed"
    )


def _redirect_target(url: httpx.URL, location: str, where: str) -> httpx.URL:
    """The redirect's absolute URL when it stays on ``url``'s origin; else 400."""
    target = url.join(location)
    if (target.scheme, target.host, target.port) != (url.scheme, url.host, url.port):
        raise BadRequest(
            f"audio_url redirected to another origin ({target.scheme}://{target.host}); refused",
            param=where,
            code="media_redirect_refused",
        )
    return target


def read_local(url: str, policy: MediaPolicy, where: str) -> bytes:
    """The file a ``file:`` URL names, when it resolves inside ``policy.local_root`` (blocking: run it
    in a thread)."""
    if policy.local_root is None:
        raise BadRequest(
            "audio_url file: URLs are refused: local paths are read only under --allowed-local-media-path",
            param=where,
            code="media_url_not_allowed",
        )
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise BadRequest("file: URLs must name a local path", param=where, code="invalid_media_url")
    path = Path(urllib.parse.unquote(parts.path))
    # Resolve first (``..`` and every symlink that exists), then check the prefix: the answer never
    # says whether a file outside the root exists.
    try:
        real = path.resolve() if path.is_absolute() else None
    except (OSError, RuntimeError, ValueError) as exc:  # a symlink loop, a NUL byte in the path
        raise BadRequest(
            f"audio_url is not a usable path: {exc}", param=where, code="invalid_media_url"
        ) from None
    if real is None or not real.is_relative_to(policy.local_root):
        raise BadRequest(
            "audio_url path is outside --allowed-local-media-path", param=where, code="media_url_not_allowed"
        )
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise BadRequest(
            f"cannot read audio_url: {exc.strerror}", param=where, code="media_not_found"
        ) from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise BadRequest("audio_url does not name a regular file", param=where, code="invalid_media_url")
        if info.st_size > policy.max_bytes:
            raise _too_large(policy, where)
        data = f.read(policy.max_bytes + 1)
    if len(data) > policy.max_bytes:  # the file grew after fstat
        raise _too_large(policy, where)
    return data
