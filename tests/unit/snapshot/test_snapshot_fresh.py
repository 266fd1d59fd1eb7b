"""snapshot/fresh.py: a restored parent becomes the pod's process and draws from new random states.

Run in a child interpreter: taking a start replaces the whole environment and directory."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

CHILD = r"""
import json, os, random, sys, tempfile
import numpy
import torch
from keepwarm_runtime.snapshot import fresh
from keepwarm_runtime.snapshot.wire import Context

made_before = random.Random(1234)
if sys.argv[1] == "remembered":  # as the checkpointed parent does before its dump
    assert fresh.remember_generators() >= 1
before = fresh.fingerprints()
made_first = made_before.random()
made_before.seed(1234)
ctx = Context(("keepwarm", "serve", "m"), {"ONLY": "this", "PATH": os.environ["PATH"]}, "/tmp", 0o027,
              1.0, 2.0, "d", rlimits={"RLIMIT_NOFILE": [256, 256]})
fresh.take_start(ctx)
reseeded = fresh.reseed()
after = fresh.fingerprints()
import resource
print(json.dumps({
    "before": before, "after": after, "reseeded": reseeded,
    "instance_moved": made_before.random() != made_first,
    "env": dict(os.environ), "argv": sys.argv, "cwd": os.getcwd(), "umask": os.umask(0),
    "child_env": os.popen("env").read(), "nofile": resource.getrlimit(resource.RLIMIT_NOFILE),
}))
"""


@pytest.mark.parametrize("generators", ["remembered", "searched"])
def test_a_restored_parent_takes_the_pods_start_and_new_random_states(generators: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, generators], capture_output=True, text=True, check=True, timeout=300
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(got["env"]) == {"ONLY", "PATH"} and "ONLY=this" in got["child_env"]  # the C environ too
    assert got["argv"] == ["keepwarm", "serve", "m"] and got["cwd"] == "/tmp" and got["umask"] == 0o027
    assert got["nofile"] == [256, 256]
    assert set(got["before"]) == set(got["after"]) == {"random", "tempfile", "authkey", "numpy", "torch"}
    assert all(got["before"][name] != got["after"][name] for name in got["before"]), got
    assert got["instance_moved"]  # a random.Random an import made was reseeded too
    assert {"random", "numpy", "torch", "multiprocessing authkey", "tempfile"} <= set(got["reseeded"])
