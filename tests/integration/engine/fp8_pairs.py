"""A random bfloat16 checkpoint and its FP8 (block-scaled) twin, for the tests that compare the two."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


def bf16_and_fp8(factory: pytest.TempPathFactory, name: str, arch: str, **shape) -> tuple[Path, Path]:
    """A 2M-parameter ``arch`` checkpoint in bfloat16, then a copy quantized to FP8 in place."""
    from keepwarm_runtime.modelgen import make_model
    from keepwarm_runtime.modelgen.fp8 import quantize_checkpoint

    src = make_model(
        factory.mktemp(f"bf16-{name}"), arch=arch, params="2M", dtype="bfloat16", vocab_size=2048, **shape
    )
    fp8 = factory.mktemp(f"fp8-{name}")
    shutil.copytree(src, fp8, dirs_exist_ok=True)
    return src, quantize_checkpoint(fp8)
