"""Shared fixtures: generated checkpoints (no hub access) and the GPU skip."""

from __future__ import annotations

from pathlib import Path

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `gpu` tests without CUDA, so `make test` stays green on CPU machines."""
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
