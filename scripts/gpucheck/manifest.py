"""What the GPU run carries, and what the GPU machine already has: the facts gpu-prepare and gpu-check share.

The carried versions are also the development venv's: `python3 scripts/gpucheck/manifest.py` prints
them as pip constraints and the Makefile installs the venv under them, so the web stack the GPU run
serves with is the one the CPU suite tested, not whatever the registry holds that day.

The GPU machine (one H200) has Python 3.12, torch and transformers but no flashinfer, and it reaches no
network. A run there sends the working tree plus at most 8 carried ignored paths, 64 MiB in all, so the
missing packages travel as one solid xz archive of their installed tree (flashinfer's 101 MB wheel is
717 MB of mostly C++ sources, which compress ~22x together against ~7x file by file in the wheel).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOWNLOAD_DIR = REPO / ".whl" / "download"  # the wheels as fetched (never carried)
CARRY_DIR = REPO / ".whl" / "gpu"  # the one carried path: the archive and its manifest
ARCHIVE = CARRY_DIR / "site.tar.xz"
ARCHIVE_MANIFEST = CARRY_DIR / "site.json"  # pins and sha256 of the archive, written by gpu-prepare
LOCAL_DIR = REPO / ".whl" / "local"  # stand-ins built for this machine's Python, for the dry run only
CARRY_LIMIT_BYTES = 64 << 20  # working tree + carried paths, per device call
CARRY_PATHS = [CARRY_DIR.relative_to(REPO).as_posix()]

# The device machine's interpreter and platform, for `pip download`.
TARGET_PYTHON = "3.12"
TARGET_PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64"]
TARGET_PLATFORMS += ["manylinux2014_x86_64"]
SITE_ON_DEVICE = "/tmp/keepwarm-gpu-site"  # where gpu-check unpacks the archive there


@dataclass(frozen=True)
class Pin:
    name: str  # distribution name as on PyPI
    version: str
    modules: tuple[str, ...]  # top-level modules it provides
    why: str
    # Carried although the image has the distribution: the archive's copy comes first on PYTHONPATH
    # there, for a version the image's may not satisfy. `why` must say which requirement forces it.
    shadows_image: bool = False


# Carried: what the GPU run imports and the image lacks. Exact versions, one of each.
CARRIED: list[Pin] = [
    Pin(
        "flashinfer-python",
        "0.7.4",
        ("flashinfer",),
        "the FlashInfer attention backend (JIT-compiled there with nvcc)",
    ),
    Pin("apache-tvm-ffi", "0.1.15.post2", ("tvm_ffi",), "flashinfer.jit imports tvm_ffi at import time"),
    Pin("blake3", "1.0.11", ("blake3",), "snapshot/store.py hashes snapshot images with it (snapshot steps)"),
    # The web stack of a `keepwarm serve` process (bench restart's serve cases start whole servers),
    # at this venv's versions. The image has its other needs: anyio, click, h11, annotated-doc, httpx.
    Pin("fastapi", "0.165.0", ("fastapi",), "server/app.py and server/base/errors.py build the app on it"),
    Pin("starlette", "1.10.0", ("starlette",), "fastapi's ASGI core; server/base/errors.py imports it too"),
    Pin("uvicorn", "0.55.0", ("uvicorn",), "server/cli.py serves the app with uvicorn"),
    Pin("pydantic", "2.14.4", ("pydantic",), "the request and response models (server/**/protocol.py)"),
    Pin("pydantic-core", "2.50.5", ("pydantic_core",), "pydantic 2.14.4 requires exactly this build"),
    Pin("annotated-types", "0.8.0", ("annotated_types",), "pydantic requires it"),
    Pin("typing-inspection", "0.4.5", ("typing_inspection",), "pydantic and fastapi require it"),
    Pin(
        "opentelemetry-api",
        "1.45.2",
        ("opentelemetry",),
        "fastapi 0.165 requires it and imports it unconditionally (fastapi.telemetry, from routing.py)",
    ),
    Pin(
        "typing-extensions",
        "4.16.0",
        ("typing_extensions",),
        "pydantic 2.14 and pydantic-core 2.50 require typing-extensions>=4.16.0 (typing-inspection "
        ">=4.15); the image has typing-extensions at a version nobody has read, so this copy shadows it",
        shadows_image=True,
    ),
]

# For the dry run only, never carried: the GPU image's own versions of pure-Python packages the run
# leans on (KINDS.md's pip list), and image packages this venv lacks that a carried one imports. The
# dry run puts them ahead of this venv's copies, so it imports what the GPU machine will.
LOCAL_STANDINS: list[Pin] = [
    Pin("transformers", "5.17.0", ("transformers",), "the image's version (this venv's is newer)"),
    Pin("huggingface-hub", "1.33.0", ("huggingface_hub",), "transformers 5.17 needs huggingface-hub < 2"),
    Pin("nvidia-ml-py", "13.615.71", ("pynvml",), "in the GPU image; `import flashinfer` needs pynvml"),
]

# Requirements of carried packages that stay behind, each with the reason; the dry run proves the
# GPU run's imports resolve without them. gpu-prepare fails on a requirement that is in none of:
# the image, CARRIED, NOT_CARRIED.
NOT_CARRIED: dict[str, str] = {
    "cuda-python": "meta package; the image has cuda-bindings, cuda-core and cuda-pathfinder",
    "cuda-tile": "tile-language kernels; attention prefill/decode do not import it",
    "nccl-extensions": "multi-GPU communication; one GPU here",
    "nccl4py": "multi-GPU communication; one GPU here",
    "nvidia-cudnn-frontend": "cuDNN attention backend; keepwarm plans FA2/FA3 wrappers",
    "nvidia-cutlass-dsl": "CuTe-DSL kernels (MoE, Blackwell); imported lazily, not by attention",
}

# Seen absent on the GPU machine, though this venv's newer copies of image packages may require them
# (typer → pydantic): the dry run refuses them whatever requires them here, unless they are carried
# (then the archive's copy is what the run imports, as on the GPU machine).
KNOWN_ABSENT = {
    "pydantic",
    "pydantic-core",
    "fastapi",
    "starlette",
    "uvicorn",
    "xgrammar",
    "flashinfer-python",
}

# Distributions of this repository that the GPU run imports from the working tree (PYTHONPATH), and
# the folders that hold them: keepwarm-api's settings and podenv modules are standard library only
# (importing the package needs no pydantic), and the runtime's core reads its settings through them.
FROM_REPO = {"keepwarm-runtime", "keepwarm-api"}


def repo_paths() -> list[Path]:
    """PYTHONPATH entries of the working tree: the runtime and api packages, and the root (bench/)."""
    return [REPO / "runtime", REPO / "api", REPO]


def normalize(name: str) -> str:
    """PEP 503 normalized distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages() -> set[str]:
    """Normalized names of the distributions in the GPU machine's image."""
    lines = (Path(__file__).with_name("image_packages.txt")).read_text().splitlines()
    return {normalize(line) for line in lines if line and not line.startswith("#")}


def carried_names() -> set[str]:
    return {normalize(pin.name) for pin in CARRIED}


def shadowing_names() -> set[str]:
    """Carried distributions that the image also has (Pin.shadows_image): the archive's copy wins."""
    return {normalize(pin.name) for pin in CARRIED if pin.shadows_image}


def constraints() -> str:
    """The carried pins as a pip constraints file (the venv installs under it)."""
    lines = [f"{pin.name}=={pin.version}  # carried to the GPU run: {pin.why}" for pin in CARRIED]
    return "\n".join(["# written by scripts/gpucheck/manifest.py; do not edit", *lines]) + "\n"


if __name__ == "__main__":
    print(constraints(), end="")
