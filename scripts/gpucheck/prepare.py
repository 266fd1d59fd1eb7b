"""`scripts/gpu-prepare`: fetch the pinned wheels, check their requirements, pack what the GPU run carries.

Steps: (1) `pip download --no-deps` each pin of manifest.CARRIED for CPython 3.12 on manylinux x86-64
into .whl/download/; (2) every unconditional requirement of those wheels must be in the GPU image,
carried, or listed in NOT_CARRIED with a reason (else stop, naming it); (3) install them with
`pip install --no-deps --target` into a staging folder and pack that as one solid .whl/gpu/site.tar.xz
with a site.json beside it (pins, sha256); (4) print the carry plan. Reruns reuse what is there.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from scripts.gpucheck import carry, manifest

# xz level: -3 packs flashinfer 0.7.4 + tvm-ffi to 32 MiB in ~1 CPU-minute; -6 to 27 MiB in ~3.
XZ_LEVEL = "-3"

# Marker environment of the GPU machine's interpreter, for evaluating Requires-Dist markers.
TARGET_MARKERS = {
    "python_version": manifest.TARGET_PYTHON,
    "python_full_version": manifest.TARGET_PYTHON + ".3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "os_name": "posix",
    "extra": "",
}


def pip_python() -> str:
    """An interpreter that has pip (the uv-made venv has none)."""
    probe = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True)
    if probe.returncode == 0:
        return sys.executable
    found = shutil.which("python3")
    if found is None:
        raise SystemExit("gpu-prepare: no interpreter with pip found (need python3 -m pip)")
    return found


def target_flags() -> list[str]:
    flags = ["--only-binary=:all:", "--python-version", manifest.TARGET_PYTHON, "--implementation", "cp"]
    for platform in manifest.TARGET_PLATFORMS:
        flags += ["--platform", platform]
    return flags


def wheel_for(pin: manifest.Pin, folder: Path) -> Path | None:
    stem = pin.name.replace("-", "_")
    found = sorted(folder.glob(f"{stem}-{pin.version}-*.whl"))
    return found[0] if found else None


def download(pin: manifest.Pin, folder: Path, extra_flags: list[str]) -> Path:
    """The wheel of `pin`, fetched once into `folder`."""
    have = wheel_for(pin, folder)
    if have is not None:
        return have
    folder.mkdir(parents=True, exist_ok=True)
    argv = [pip_python(), "-m", "pip", "download", "-q", "--no-deps", *extra_flags, "-d", str(folder)]
    subprocess.run([*argv, f"{pin.name}=={pin.version}"], check=True)
    got = wheel_for(pin, folder)
    if got is None:
        raise SystemExit(f"gpu-prepare: pip saved no wheel for {pin.name}=={pin.version} in {folder}")
    return got


def requirements(wheel: Path) -> list[str]:
    """Requires-Dist lines of a wheel's METADATA."""
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(name).decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def unresolved(reqs: list[str], provided: set[str]) -> list[str]:
    """Requirements that apply on the GPU machine (markers, no extras) and nothing provides."""
    from packaging.requirements import Requirement

    missing = []
    for text in reqs:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate(TARGET_MARKERS):
            continue
        if manifest.normalize(req.name) not in provided:
            missing.append(text)
    return missing


def check_requirements(wheels: list[Path]) -> None:
    provided = manifest.image_packages() | manifest.carried_names()
    provided |= {manifest.normalize(n) for n in manifest.NOT_CARRIED}
    overlap = manifest.image_packages() & manifest.carried_names() - manifest.shadowing_names()
    if overlap:
        raise SystemExit(
            f"gpu-prepare: carrying a package the image has: {', '.join(sorted(overlap))} "
            "(mark its Pin shadows_image=True, with the requirement that forces it, if that is meant)"
        )
    problems = {w.name: unresolved(requirements(w), provided) for w in wheels}
    problems = {k: v for k, v in problems.items() if v}
    if problems:
        lines = [f"  {w}: {', '.join(reqs)}" for w, reqs in problems.items()]
        raise SystemExit(
            "gpu-prepare: requirements neither in the GPU image, carried, nor in NOT_CARRIED:\n"
            + "\n".join(lines)
        )


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def pins_record() -> list[dict[str, str]]:
    return [{"name": p.name, "version": p.version} for p in manifest.CARRIED]


def archive_is_current() -> bool:
    """True when site.tar.xz exists, matches its site.json and was built from today's pins."""
    if not (manifest.ARCHIVE.exists() and manifest.ARCHIVE_MANIFEST.exists()):
        return False
    record = json.loads(manifest.ARCHIVE_MANIFEST.read_text())
    return record.get("pins") == pins_record() and record.get("sha256") == sha256(manifest.ARCHIVE)


def pack(wheels: list[Path]) -> None:
    """Install the wheels (no deps) into a staging folder and pack it as one solid xz archive."""
    manifest.CARRY_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="keepwarm-gpu-stage-") as stage:
        argv = [pip_python(), "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        argv += ["--target", stage, *target_flags(), *map(str, wheels)]
        subprocess.run(argv, check=True)
        partial = manifest.ARCHIVE.with_suffix(".partial")
        with partial.open("wb") as out:
            tar = subprocess.Popen(
                ["tar", "-C", stage, "--sort=name", "--owner=0", "--group=0", "-cf", "-", "."],
                stdout=subprocess.PIPE,
            )
            subprocess.run(["xz", "-T0", XZ_LEVEL, "-c"], stdin=tar.stdout, stdout=out, check=True)
            if tar.wait() != 0:
                raise SystemExit("gpu-prepare: tar failed")
        partial.rename(manifest.ARCHIVE)
    record = {
        "pins": pins_record(),
        "sha256": sha256(manifest.ARCHIVE),
        "bytes": manifest.ARCHIVE.stat().st_size,
    }
    manifest.ARCHIVE_MANIFEST.write_text(json.dumps(record, indent=2) + "\n")


def carry_plan() -> list[carry.CallPlan]:
    carried = {p: carry.path_bytes(manifest.REPO / p) for p in manifest.CARRY_PATHS}
    return carry.plan_calls(carry.tree_bytes(manifest.REPO), carried, manifest.CARRY_LIMIT_BYTES)


def describe_calls(calls: list[carry.CallPlan]) -> str:
    lines = []
    for i, call in enumerate(calls, 1):
        lines.append(
            f"call {i}: carry {call.carry} = {call.carry_bytes / 2**20:.1f} MiB + working tree "
            f"{call.tree_bytes / 2**20:.1f} MiB = {call.total_bytes / 2**20:.1f} MiB "
            f"(limit {manifest.CARRY_LIMIT_BYTES / 2**20:.0f} MiB)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    wheels = [download(pin, manifest.DOWNLOAD_DIR, target_flags()) for pin in manifest.CARRIED]
    check_requirements(wheels)
    if archive_is_current():
        print(f"gpu-prepare: {manifest.ARCHIVE.relative_to(manifest.REPO)} is current")
    else:
        print("gpu-prepare: packing (xz; a few minutes on a small machine) ...", flush=True)
        pack(wheels)
    print(describe_calls(carry_plan()))
    return 0
