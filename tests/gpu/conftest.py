"""What the GPU tests share: the small generated checkpoints they run on."""

from __future__ import annotations

import pytest

GPU_PARAMS = "6M"  # hidden 256 -> head_dim 64 (the 1M preset's head_dim 16 is no FlashInfer kernel shape)


@pytest.fixture(scope="session")
def gpu_model(tmp_path_factory):
    """``gpu_model(arch)``: a float32 checkpoint of ``arch`` at GPU_PARAMS, made once per session (sharp
    attention: initializer range 0.15, as the CPU engine tests')."""
    from keepwarm_runtime.modelgen import make_model

    made = {}

    def make(arch: str):
        if arch not in made:
            out = tmp_path_factory.mktemp(f"gpu-{arch}")
            made[arch] = make_model(
                out, arch=arch, params=GPU_PARAMS, dtype="float32", vocab_size=2048, initializer_range=0.15
            )
        return made[arch]

    return make
