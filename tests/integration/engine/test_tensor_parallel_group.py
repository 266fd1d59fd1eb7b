"""The process group of two real rank processes (gloo, a file rendezvous): they meet, agree on the
smallest KV-cache size, and refuse to serve shards of two checkpoints, naming what each rank attached;
a rendezvous of an unknown kind is refused by name."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from keepwarm_runtime.engine.parallel.group import GroupError, rendezvous_store
from keepwarm_runtime.engine.parallel.launch import rendezvous

RANK = textwrap.dedent(
    """
    import json, sys
    from keepwarm_runtime.engine.config import EngineConfig
    from keepwarm_runtime.engine.parallel import group

    rank, meet, files = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    config = EngineConfig(
        "unused", tensor_parallel_size=2, tensor_parallel_rank=rank, distributed_init_method=meet
    )
    assert group.join(config)
    out = {"fewest": group.fewest(100 + rank)}
    try:
        group.check_same_checkpoint(files, "cache" if rank == 0 else "disk")
        out["same"] = True
    except group.GroupError as exc:
        out["same"], out["error"] = False, str(exc)
    print(json.dumps(out), flush=True)
    """
)


def _group(files: tuple[str, str], where) -> list[dict]:
    meet = rendezvous(where)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(r), meet, files[r]], stdout=subprocess.PIPE, text=True
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    return [json.loads(o.strip().splitlines()[-1]) for o in outs]


@pytest.mark.extended
def test_ranks_agree_on_the_smallest_kv_cache_and_one_checkpoint(tmp_path) -> None:
    same = _group(("a" * 64, "a" * 64), tmp_path)
    assert [r["fewest"] for r in same] == [100, 100] and all(r["same"] for r in same)
    mixed = _group(("a" * 64, "b" * 64), tmp_path)
    assert not any(r["same"] for r in mixed)
    for result in mixed:  # every rank refuses, naming what each attached and from where
        assert "rank 0: aaaaaaaaaaaaaaaa cache" in result["error"]
        assert "rank 1: bbbbbbbbbbbbbbbb disk" in result["error"]


def test_a_rendezvous_of_an_unknown_kind_is_refused() -> None:
    with pytest.raises(GroupError, match=r"use file://PATH or tcp://HOST:PORT"):
        rendezvous_store("etcd://somewhere", 0, 2)
