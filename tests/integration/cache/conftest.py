"""Real daemon processes for the cache integration tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from keepwarm_runtime.cache.launcher import DaemonProcess, HolderProcess


def write_checkpoint(path: Path, seed: int, rows: int = 64) -> Path:
    """A small safetensors checkpoint without transformers (the daemon only reads raw files)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    save_file(
        {
            "a.weight": torch.randn(rows, 1024, generator=g).bfloat16(),
            "b.steps": torch.arange(5, dtype=torch.int64),
        },
        path / "model.safetensors",
    )
    (path / "config.json").write_text('{"architectures": ["TinyForTest"], "model_type": "tiny"}')
    return path


@pytest.fixture
def daemon_factory():
    started: list[DaemonProcess] = []

    def start(socket_dir: Path, models: list[Path], *extra: str, **kw) -> DaemonProcess:
        d = DaemonProcess(socket_dir, models, *extra, **kw)
        started.append(d)
        return d

    yield start
    for d in started:
        d.kill()


@pytest.fixture
def holder_factory():
    """Start a descriptor holder (`keepwarm cache hold`) for a socket dir, ready; killed at the end."""
    started: list[HolderProcess] = []

    def start(socket_dir: Path, *extra: str) -> HolderProcess:
        started.append(HolderProcess(socket_dir, *extra))
        return started[-1].wait_ready()

    yield start
    for h in started:
        h.kill()


@pytest.fixture(scope="session")
def checkpoint_writer():
    return write_checkpoint


class WarmCache:
    """One daemon shared by a test module: tiny Llama (pinned, served float32) plus two small models
    under a budget that fits only one of them: the first loads, the second is refused at start
    (a WARNING and a Failed entry; nothing is evicted at start)."""

    def __init__(self, root: Path, tiny: Path) -> None:
        from keepwarm_runtime.weights.arena import plan_layout
        from keepwarm_runtime.weights.checkpoint import read_checkpoint

        self.root = root
        self.socket_dir = root / "wc"
        self.tiny = tiny
        self.loaded = write_checkpoint(root / "models" / "loaded", seed=1, rows=512)  # 2 MiB in float32
        self.unfit = write_checkpoint(root / "models" / "unfit", seed=2, rows=511)  # other header
        tiny_bytes = plan_layout(read_checkpoint(tiny), torch.float32).size
        budget = tiny_bytes + (3 << 20)  # tiny + one 2 MiB model fit; tiny + two do not
        self.daemon = DaemonProcess(
            self.socket_dir,
            [tiny, self.loaded, self.unfit],
            "--dtype",
            "float32",
            "--budget",
            str(budget),
            "--pin",
            tiny.name,
            "--group",
            "nogroup",
        ).wait_ready()


@pytest.fixture(scope="module")
def warm_cache(tiny_llama: Path):
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="keepwarm-it-"))
    os.chmod(root, 0o755)  # the `nobody` client must reach the socket dir (which is 0770 nogroup)
    cache = WarmCache(root, tiny_llama)
    yield cache
    cache.daemon.kill()
    import shutil

    shutil.rmtree(root, ignore_errors=True)


def assert_zero_copy_and_identical(res, model_dir: Path, dtype: torch.dtype) -> None:
    """``res`` came from the cache, every tensor lies in a shared read-only keepwarm mapping of this
    process, and the bytes equal a plain disk load of ``model_dir``."""
    from keepwarm_runtime.cache.client import attach

    assert (res.source, res.reason) == ("cache", None), res.reason
    maps = Path("/proc/self/maps").read_text().splitlines()
    regions = [
        tuple(int(x, 16) for x in line.split()[0].split("-"))
        for line in maps
        if "keepwarm:" in line and "r--s" in line
    ]
    disk = attach(model_dir, None, dtype=dtype)
    assert res.tensors.keys() == disk.tensors.keys()
    for name, t in disk.tensors.items():
        assert torch.equal(res.tensors[name], t), name
        if t.numel():
            ptr = res.tensors[name].data_ptr()
            assert any(lo <= ptr < hi for lo, hi in regions), f"{name} is not inside a read-only arena"


@pytest.fixture(scope="session")
def assert_cached():
    """``assert_zero_copy_and_identical`` for tests (conftest is not importable as a module)."""
    return assert_zero_copy_and_identical
