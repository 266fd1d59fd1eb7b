"""Fixtures of the GPU cache tests."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A short socket directory: a GPU daemon's socket is named after the GPU's UUID (~50 bytes), and
    under pytest's per-test tmp_path the whole path passes AF_UNIX's 107-byte limit."""
    root = Path(tempfile.mkdtemp(prefix="kw-gpu-"))
    yield root / "wc"
    shutil.rmtree(root, ignore_errors=True)
