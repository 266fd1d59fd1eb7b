"""The daemon's start and its adopted path need no torch (issue 34 item 6), and a record's tensor
table, checked without torch, refuses forged rows by name.

The adopted path runs in a child interpreter in which ``import torch`` fails: it verifies a real
sealed arena handed to it with its record (adopt.py), serves a hit for it (handlers.py) and finds it
resident again by its files (core.py), as a daemon restarted after a crash does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from keepwarm_runtime.cache.adopt import Unfit, verify
from keepwarm_runtime.cache.daemon import CacheDaemon, DaemonConfig
from keepwarm_runtime.cache.handoff import ArenaRecord, record_of

HEAVY = {"torch", "transformers", "safetensors", "numpy"}


def _model(path: Path) -> Path:
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    g = torch.Generator().manual_seed(5)
    tensors = {"a.weight": torch.randn(48, 64, generator=g).bfloat16(), "b.steps": torch.arange(7)}
    save_file(tensors, path / "model.safetensors")
    (path / "config.json").write_text('{"architectures": ["TinyForTest"], "model_type": "tiny"}')
    return path


@pytest.fixture
def loaded(tmp_path):
    """A daemon that loaded one model (with torch), and that model's record as a successor gets it."""
    daemon = CacheDaemon(DaemonConfig(socket_dir=tmp_path / "old", tier="host", dtype="bfloat16"))
    name = daemon.add_model(_model(tmp_path / "models" / "m"))
    yield daemon, record_of(daemon.registry.get(name))
    daemon.close()


def test_the_daemon_start_path_imports_no_torch():
    code = (
        "import json, sys\n"
        "import keepwarm_runtime.cli as cli\n"
        "cli.build_parser()\n"
        "import keepwarm_runtime.node, keepwarm_runtime.cache.daemon, keepwarm_runtime.cache.holder_link\n"
        "import keepwarm_runtime.cache.backends.cuda, keepwarm_runtime.cache.backends.host\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert HEAVY.isdisjoint(json.loads(out))


CHILD = """
import json, os, sys
sys.modules["torch"] = None  # any import of torch now raises ImportError
from keepwarm_runtime.cache.adopt import verify
from keepwarm_runtime.cache.core import DaemonConfig
from keepwarm_runtime.cache.daemon import CacheDaemon
from keepwarm_runtime.cache.handoff import ArenaRecord

record, fd, socket_dir = json.loads(sys.stdin.read())
daemon = CacheDaemon(DaemonConfig(socket_dir=socket_dir, tier="host", dtype="bfloat16"))
model = verify(daemon, ArenaRecord.from_wire(record), fd)
daemon.registry.insert(model)
reply, fds = daemon.handlers.dispatch({"cmd": "get_state", "key": record["key"]})
again = daemon.add_model(model.path)  # resident: found by its files, not read
print(json.dumps({"reply": reply, "fds": len(fds), "again": again, "name": model.name}))
"""


def test_an_adopted_arena_is_verified_and_served_where_torch_cannot_be_imported(loaded, tmp_path):
    daemon, record = loaded
    fd = os.dup(daemon.registry.get(record.name).arena.fd)
    try:
        child = subprocess.run(
            [sys.executable, "-c", CHILD],
            input=json.dumps([record.to_wire(), fd, str(tmp_path / "new")]),
            capture_output=True,
            text=True,
            pass_fds=[fd],
            timeout=120,
        )
    finally:
        os.close(fd)
    assert child.returncode == 0, child.stderr[-3000:]
    out = json.loads(child.stdout)
    assert out["reply"]["state"] == "hit" and out["fds"] == 1
    assert out["reply"]["tensors"] == record.tensors and out["reply"]["digest"] == record.digest
    assert out["again"] == out["name"] == record.name
    assert "loaded" not in child.stderr


@pytest.mark.parametrize(
    ("rows", "why"),
    [
        (lambda t: [[*t[0][:4], t[0][4] + 2], *t[1:]], "is malformed"),  # bytes that do not hold the shape
        (lambda t: [[t[0][0], "float128", *t[0][2:]], *t[1:]], "unknown dtype"),
        (lambda t: [[*t[0][:3], -256, t[0][4]], *t[1:]], "is malformed"),  # before the arena
        (lambda t: [[t[0][0], t[0][1], ["2"], *t[0][3:]], *t[1:]], "malformed shape"),
        (lambda t: [t[0][:4], *t[1:]], "is not [name, dtype, shape, offset, nbytes]"),
        (lambda t: [[*t[0][:3], 1 << 40, t[0][4]], *t[1:]], "do not fit"),  # past the arena's end
    ],
)
def test_forged_tensor_rows_are_refused_by_name(loaded, tmp_path, rows, why):
    daemon, record = loaded
    forged = ArenaRecord.from_wire({**record.to_wire(), "tensors": rows(record.tensors)})
    successor = CacheDaemon(DaemonConfig(socket_dir=tmp_path / "new", tier="host", dtype="bfloat16"))
    fd = os.dup(daemon.registry.get(record.name).arena.fd)
    try:
        with pytest.raises(Unfit, match="layout") as info:
            verify(successor, forged, fd)
        assert why in str(info.value)
    finally:
        os.close(fd)
