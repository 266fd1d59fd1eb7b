"""One small Qwen3-MoE checkpoint served by a gpu-tier cache daemon on cuda:0, for the GPU tests whose
daemon converts the experts at load (an expert layout, online FP8)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from keepwarm_runtime.cache.launcher import DaemonProcess

SHAPES = {"hidden_size": 256, "moe_intermediate_size": 128, "intermediate_size": 256, "head_dim": 64}


def gpu_moe_daemon(root: Path, *daemon_args: str) -> Iterator[tuple[Path, Path]]:
    """Yields (model dir, socket dir) while a bf16 gpu-tier daemon started with `daemon_args` holds
    a generated 4M Qwen3-MoE under `root`; a module fixture yields from it."""
    from keepwarm_runtime.modelgen import make_model

    model = make_model(root / "qwen3_moe", arch="qwen3_moe", params="4M", dtype="bfloat16", **SHAPES)
    daemon = DaemonProcess(
        root / "wc", [model], "--device", "cuda:0", "--dtype", "bfloat16", *daemon_args, tier="gpu"
    ).wait_ready()
    yield model, root / "wc"
    daemon.terminate(60)
