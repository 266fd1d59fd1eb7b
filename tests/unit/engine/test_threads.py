"""engine/threads.py: the thread count from affinity, cgroup quota and the user's settings."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from keepwarm_runtime.engine import threads as t


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("max 100000\n", None), ("150000 100000\n", 1.5), ("50000 100000", 0.5), ("200000", 2.0), ("", None)],
)
def test_cpu_max(text, cpus):
    assert t.parse_cpu_max(text) == cpus


def test_cfs_v1_minus_one_is_unlimited():
    assert t.parse_cfs("-1\n", "100000\n") is None
    assert t.parse_cfs("250000\n", "100000\n") == 2.5


def test_cgroup_paths_of_hybrid_and_pure_v2_hosts():
    hybrid = "12:cpu,cpuacct:/kubepods/pod1/c1\n4:memory:/x\n0::/kubepods/pod1/c1\n"
    assert t.cgroup_paths(hybrid) == ("/kubepods/pod1/c1", "/kubepods/pod1/c1")
    assert t.cgroup_paths("0::/\n") == ("/", None)
    assert t.cgroup_paths("") == (None, None)


def _write(path: Path, name: str, text: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / name).write_text(text)


def test_tightest_quota_over_the_cgroup_and_its_parents_v2(tmp_path: Path):
    _write(tmp_path / "kubepods", "cpu.max", "300000 100000\n")
    _write(tmp_path / "kubepods" / "pod1", "cpu.max", "max 100000\n")
    _write(tmp_path / "kubepods" / "pod1" / "c1", "cpu.max", "max 100000\n")
    assert t.cgroup_cpu_limit(tmp_path, "0::/kubepods/pod1/c1\n") == 3.0
    _write(tmp_path / "kubepods" / "pod1" / "c1", "cpu.max", "120000 100000\n")
    assert t.cgroup_cpu_limit(tmp_path, "0::/kubepods/pod1/c1\n") == 1.2


def test_container_mount_root_is_read_when_the_host_path_is_absent(tmp_path: Path):
    _write(tmp_path, "cpu.max", "150000 100000\n")  # cgroup namespace: the mount is our own cgroup
    assert t.cgroup_cpu_limit(tmp_path, "0::/kubepods/pod1/c1\n") == 1.5


def test_v1_cfs_quota(tmp_path: Path):
    v1 = tmp_path / "cpu,cpuacct"
    _write(v1, "cpu.cfs_quota_us", "-1\n")
    _write(v1, "cpu.cfs_period_us", "100000\n")
    proc = "3:cpu,cpuacct:/docker/abc\n"
    assert t.cgroup_cpu_limit(tmp_path, proc) is None
    _write(v1 / "docker" / "abc", "cpu.cfs_quota_us", "50000\n")
    _write(v1 / "docker" / "abc", "cpu.cfs_period_us", "100000\n")
    assert t.cgroup_cpu_limit(tmp_path, proc) == 0.5


def test_no_cgroup_files_means_no_limit(tmp_path: Path):
    _write(tmp_path, "cpu.max", "garbage\n")  # unreadable contents are ignored, not fatal
    assert t.cgroup_cpu_limit(tmp_path, "0::/\n") is None


def test_derive_from_affinity_and_quota():
    assert t.derive_threads(8, None) == t.ThreadChoice(8, "8 CPUs in the affinity mask")
    assert t.derive_threads(8, 2.5).threads == 2
    assert "quota 2.5" in t.derive_threads(8, 2.5).reason
    assert t.derive_threads(2, 4.0).threads == 2  # a quota above the mask changes nothing
    assert t.derive_threads(4, 0.5).threads == 1  # never below one


def test_explicit_settings_win_in_order():
    assert t.derive_threads(8, 1.0, requested=3) == t.ThreadChoice(3, "--threads/KEEPWARM_THREADS")
    assert t.derive_threads(8, 1.0, requested=3, omp_num_threads="5").threads == 3
    assert t.derive_threads(8, 1.0, omp_num_threads="5") == t.ThreadChoice(5, "OMP_NUM_THREADS")
    assert t.derive_threads(8, None, omp_num_threads="4,2").threads == 4
    assert t.derive_threads(8, None, omp_num_threads=" ").threads == 8


def test_bad_values_are_refused_by_name():
    with pytest.raises(ValueError, match="--threads must be at least 1"):
        t.derive_threads(8, None, requested=0)
    with pytest.raises(ValueError, match="OMP_NUM_THREADS"):
        t.derive_threads(8, None, omp_num_threads="many")


def test_prepare_openmp_sets_a_bounded_spin_but_keeps_the_users(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # as in `keepwarm serve` before torch
    env = {"KMP_BLOCKTIME": "200"}
    assert t.prepare_openmp(t.ThreadChoice(3, "test"), env) is True
    spin = t.OPENMP_WAIT_DEFAULTS["GOMP_SPINCOUNT"]
    assert env == {"OMP_NUM_THREADS": "3", "GOMP_SPINCOUNT": spin, "KMP_BLOCKTIME": "200"}


def test_prepare_openmp_leaves_a_users_wait_policy_alone(monkeypatch):
    """OMP_WAIT_POLICY brings its own spin count: a GOMP_SPINCOUNT beside it would override it."""
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    env = {"OMP_WAIT_POLICY": "PASSIVE"}
    assert t.prepare_openmp(t.ThreadChoice(2, "test"), env) is True
    assert env == {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}


def test_prepare_openmp_after_torch_changes_nothing():
    import torch  # noqa: F401

    env: dict[str, str] = {}
    assert t.prepare_openmp(t.ThreadChoice(3, "test"), env) is False
    assert env == {}
