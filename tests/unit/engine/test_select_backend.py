"""Attention backend selection: FlashInfer failures at import or at kernel warm-up fall back to torch
under `auto` with a logged reason, and are a named error under an explicit `flashinfer`."""

from __future__ import annotations

import logging

import pytest
import torch

from keepwarm_runtime.engine.attention.select import BackendUnavailable, select_backend
from keepwarm_runtime.engine.attention.torch_backend import TorchAttentionBackend

CUDA = torch.device("cuda")  # a device object only: nothing here touches a GPU
LOGGER = "keepwarm_runtime.engine.attention.select"


def kernel_missing(device: torch.device):
    raise RuntimeError("Ninja build failed: nvcc not found\n(JIT compiling batch_decode for sm_90)")


def test_auto_falls_back_to_torch_when_a_kernel_cannot_load_and_logs_why(caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        backend = select_backend("auto", CUDA, load_flashinfer=kernel_missing)
    assert isinstance(backend, TorchAttentionBackend)
    (record,) = [r for r in caplog.records if r.name == LOGGER]
    assert "torch backend" in record.getMessage()
    assert "warm-up" in record.getMessage() and "nvcc not found" in record.getMessage()
    assert "\n" not in record.getMessage()


def test_explicit_flashinfer_names_the_kernel_failure():
    with pytest.raises(BackendUnavailable, match="nvcc not found"):
        select_backend("flashinfer", CUDA, load_flashinfer=kernel_missing)


def test_auto_uses_flashinfer_when_it_warms_up():
    sentinel = object()
    assert select_backend("auto", CUDA, load_flashinfer=lambda device: sentinel) is sentinel


def test_cpu_never_tries_flashinfer():
    def must_not_run(device):
        raise AssertionError("FlashInfer loaded on a CPU device")

    assert isinstance(select_backend("auto", torch.device("cpu"), must_not_run), TorchAttentionBackend)
    with pytest.raises(BackendUnavailable, match="needs a CUDA device"):
        select_backend("flashinfer", torch.device("cpu"), must_not_run)


def test_the_real_loader_falls_back_on_this_machine(caplog):
    """Without flashinfer (or without a GPU for its warm-up), the real path ends on torch, logged."""
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        backend = select_backend("auto", CUDA)
    assert isinstance(backend, TorchAttentionBackend)
    message = " ".join(r.getMessage() for r in caplog.records if r.name == LOGGER)
    assert "FlashInfer cannot run here" in message
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        assert "keepwarm-runtime[gpu]" in message
