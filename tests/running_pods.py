"""What the tests that run real pods share: they need root (namespaces, mounts, cgroups)."""

from __future__ import annotations

import os

import pytest

NEEDS_ROOT = pytest.mark.skipif(
    os.geteuid() != 0, reason="running pods needs root (namespaces, mounts, cgroups)"
)
