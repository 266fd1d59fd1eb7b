"""The GPU run's first step: what machine and versions produced the figures, as one JSON document.

Exits non-zero when CUDA is not visible, so a run on the wrong machine says so at once. Also lists
each carried package's version in use and any requirement of it that the image's packages do not meet
(gpu-prepare checks requirement names only: the image's versions of anyio, click, h11 are not known
here), so a step that then fails on an import says why.
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


def carried_requirements() -> dict:
    """{"versions": {carried distribution: version in use}, "unmet": [requirement: what is there]},
    leaving out the requirements manifest.NOT_CARRIED leaves behind on purpose."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    from scripts.gpucheck import manifest

    versions, unmet = {}, []
    for pin in manifest.CARRIED:
        try:
            dist = md.distribution(pin.name)
        except md.PackageNotFoundError:
            versions[pin.name] = None
            continue
        versions[pin.name] = dist.version
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            if manifest.normalize(req.name) in manifest.NOT_CARRIED:  # left behind on purpose
                continue
            try:
                have = md.version(req.name)
            except md.PackageNotFoundError:
                have = None
            if have is None or not req.specifier.contains(have, prereleases=True):
                unmet.append(f"{pin.name} needs {text}: {have or 'absent'}")
    return {"versions": versions, "unmet": unmet}


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
    try:
        info["carried"] = carried_requirements()
    except Exception as exc:  # report, never fail
        info["carried"] = f"unavailable: {type(exc).__name__}: {exc}"
    if info["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        info |= {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1)}
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    print(json.dumps(info, indent=2))
    return 0 if info["cuda_available"] else 2


if __name__ == "__main__":
    sys.exit(main())
