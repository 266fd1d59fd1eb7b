"""The GPU run's first step: what machine and versions produced the figures, as one JSON document.

Exits non-zero when CUDA is not visible, so a run on the wrong machine says so at once.
"""

from __future__ import annotations

import importlib
import json
import platform
import shutil
import subprocess
import sys


def _version(module: str) -> str | None:
    try:
        return str(importlib.import_module(module).__version__)
    except Exception as exc:  # report, never fail: a missing optional part is a fact to record
        return f"unavailable: {type(exc).__name__}: {exc}"


def _run(argv: list[str]) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    done = subprocess.run(argv, capture_output=True, text=True, timeout=15)
    return (done.stdout or done.stderr).strip()


def main() -> int:
    import torch

    info = {
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "transformers": _version("transformers"),
        "safetensors": _version("safetensors"),
        "flashinfer": _version("flashinfer"),
        "nvidia_smi": _run(
            ["nvidia-smi", "--query-gpu=name,uuid,driver_version,memory.total", "--format=csv,noheader"]
        ),
        "nvcc": _run(["nvcc", "--version"]),
    }
    if info["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        info |= {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1)}
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    print(json.dumps(info, indent=2))
    return 0 if info["cuda_available"] else 2


if __name__ == "__main__":
    sys.exit(main())
