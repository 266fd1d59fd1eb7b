"""On a GPU with keepwarm-runtime[gpu]: FlashInfer's kernels load at warm-up, so `auto` picks it."""

from __future__ import annotations

import pytest
import torch

from keepwarm_runtime.engine.attention.select import load_warm_flashinfer, select_backend


def test_auto_selects_flashinfer_after_a_successful_warm_up():
    pytest.importorskip("flashinfer", reason="needs keepwarm-runtime[gpu]")
    device = torch.device("cuda:0")
    assert select_backend("auto", device).name == "flashinfer"
    assert load_warm_flashinfer(device).name == "flashinfer"
