"""Kubernetes hands pods the socket's group as a *supplementary* group: SO_PEERGROUPS must admit it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from keepwarm_runtime.cache import client
from keepwarm_runtime.cache.client import attach, connect

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client under other ids")
NOBODY = 65534
SHARED_GID = 4242  # the socket's group, as a pod's supplementalGroups would carry it
OTHER_GID = 4243


# Runs in a fresh interpreter started as root: it imports everything first, then takes the client's
# ids (the interpreter itself is not readable by other uids). Not a fork of the test process: a fork
# of a process whose OpenMP pool and helper threads are running can hang in the child.
CLIENT = """
import json, os, sys
from pathlib import Path
import torch
from keepwarm_runtime.cache.client import attach
uid, gid, groups, model, socket_dir = json.loads(sys.argv[1])
os.setgroups(groups)
os.setgid(gid)
os.setuid(uid)
res = attach(Path(model), Path(socket_dir), dtype=torch.bfloat16)
total = float(res.tensors["model.embed_tokens.weight"].float().sum())
print(json.dumps({"source": res.source, "reason": res.reason, "sum": total}))
"""


def _attach_as(uid: int, gid: int, groups: list[int], model: Path, socket_dir: Path) -> dict:
    """Attach as another uid with the given primary and supplementary groups; the result as a dict."""
    args = json.dumps([uid, gid, groups, str(model), str(socket_dir)])
    done = subprocess.run(
        [sys.executable, "-c", CLIENT, args], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def shared_root(tiny_llama):
    root = Path(tempfile.mkdtemp(prefix="keepwarm-groups-"))
    os.chmod(root, 0o755)  # other uids must reach the socket dir and read the model
    model = Path(shutil.copytree(tiny_llama, root / "models" / "tiny"))
    for path in [root / "models", model, *model.rglob("*")]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    yield root, model
    shutil.rmtree(root, ignore_errors=True)


def test_supplementary_group_is_admitted(shared_root, daemon_factory):
    root, model = shared_root
    socket_dir = root / "wc"
    daemon_factory(
        socket_dir, [model], "--group", str(SHARED_GID), "--allow-gid", str(SHARED_GID)
    ).wait_ready()
    disk_sum = float(
        attach(model, None, dtype=torch.bfloat16).tensors["model.embed_tokens.weight"].float().sum()
    )

    admitted = _attach_as(NOBODY, NOBODY, [SHARED_GID], model, socket_dir)
    assert admitted == {"source": "cache", "reason": None, "sum": disk_sum}, admitted

    # Another supplementary group may reach the socket file only through the group's mode; here
    # the peer check is what refuses it (primary gid and supplementary gid both not allowed).
    os.chmod(socket_dir, 0o775)
    os.chmod(socket_dir / "host.sock", 0o666)
    refused = _attach_as(NOBODY, NOBODY, [OTHER_GID], model, socket_dir)
    assert refused["source"] == "disk" and refused["reason"] == "error: forbidden", refused
    # The node agent reads the refusal from the daemon's stats to report it on the WeightCacheNode.
    with connect(socket_dir / "host.sock", 30.0) as sock:
        refusals = client.request(sock, {"cmd": "stats"})[0]["refusals"]
    assert refusals["count"] == 1 and f"uid {NOBODY} with gids [{OTHER_GID}, {NOBODY}]" in refusals["reason"]
