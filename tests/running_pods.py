"""What the tests that run real pods share: they need root (containerd, runc, namespaces, cgroups), and
a module's first test may build the node's images from the Dockerfile (minutes on a fresh machine;
`make test` builds them before pytest starts), so its time box is wider than pytest's default."""

from __future__ import annotations

import os

import pytest

NEEDS_ROOT = pytest.mark.skipif(
    os.geteuid() != 0, reason="running pods needs root (containerd, runc, namespaces, cgroups)"
)
ON_REAL_NODES = [pytest.mark.slow, NEEDS_ROOT, pytest.mark.timeout(2400)]
