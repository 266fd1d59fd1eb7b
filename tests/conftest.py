"""Shared fixtures (generated checkpoints, no hub access), and the markers a test's folder gives it.

The folder states a test's kind once: tests/integration/** and tests/e2e/** (real processes, a control
plane, real pods) are `integration`, tests/gpu/** is `gpu`; a module adds only what its folder does not
say (`slow`, `sweep`, a GPU test that also starts processes is `integration`).

tests/unit/<area>/ mirrors what its tests check: keepwarm_runtime's packages (weights/, engine/ with
engine/moe/, modelgen/, agent/, cache/, server/, audio/), keepwarm_api.settings' settings/, the
operator's operator/, the benchmarks' bench/, scripts/gpucheck's gpucheck/, the delivered files'
delivery/; tests/unit/*.py hold
keepwarm_runtime's top-level modules (log_once, model_kind), the test kubelet's volume writer and the
cross-cutting checks (layers, one definition, folder markers)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# tests/<folder>/** -> the markers its tests carry (`-m integration`, `-m "not gpu"` select by folder).
FOLDER_MARKERS: dict[str, tuple[str, ...]] = {
    "integration": ("integration",),
    "e2e": ("integration",),
    "gpu": ("gpu",),
}


@cache
def folder_markers(path: Path) -> tuple[str, ...]:
    """The markers tests/<folder>/ gives a test file; none outside tests/ or for files directly in it."""
    path = path.resolve()
    if not path.is_relative_to(TESTS):
        return ()
    parts = path.relative_to(TESTS).parts
    return FOLDER_MARKERS.get(parts[0], ()) if len(parts) > 1 else ()


@pytest.hookimpl(tryfirst=True)  # before pytest's own hook deselects by `-m`
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test by its folder, then skip `gpu` tests without CUDA, so `make test` stays green on
    CPU machines."""
    for item in items:
        for name in folder_markers(item.path):
            item.add_marker(name)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA (run scripts/gpu-check on a GPU machine)")
    for item in items:
        if item.get_closest_marker("gpu"):  # the marker, not the keyword: a folder named gpu is one
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ~1M-parameter random Llama checkpoint in bfloat16, sharded, with tokenizer and chat template."""
    from keepwarm_runtime.modelgen import make_model

    return make_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama", params="1M", dtype="bfloat16")
