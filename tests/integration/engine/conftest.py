"""Tiny random checkpoints of every architecture the engine is tested on, generated once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

# Larger than transformers' default init (0.02), so attention is sharp and a wrong softmax scale,
# window or mask changes the greedy tokens instead of hiding in near-uniform attention.
INIT_RANGE = 0.15


@pytest.fixture(scope="session")
def make_tiny(tmp_path_factory: pytest.TempPathFactory):
    from keepwarm_runtime.modelgen import make_model

    made: dict[tuple[str, str], Path] = {}

    def make(arch: str, dtype: str = "float32") -> Path:
        if (arch, dtype) not in made:
            out = tmp_path_factory.mktemp(f"engine-{arch}-{dtype}")
            made[arch, dtype] = make_model(
                out, arch=arch, params="400K", dtype=dtype, vocab_size=2048, initializer_range=INIT_RANGE
            )
        return made[arch, dtype]

    return make
