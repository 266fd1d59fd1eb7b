"""The images the real node runs, built from the repository's Dockerfile with buildah and pushed to the
local registry (node/registry.py).

No image registry is reachable here, so bases are made, not pulled: a Debian bookworm root made by
debootstrap from Debian's packages (python3, python3-venv, ca-certificates, plus this machine's trust
store, so apt and pip inside a build reach the package registries as this machine does) is both of the
Dockerfile's bases (PYTHON_IMAGE for the operator, DEBIAN_IMAGE for runtime-cpu), and the pod sandbox
runs keepwarm's own pause (pause.c) in an image FROM scratch. torch comes from the default package index
(TORCH_CPU_INDEX empty: the CPU index is not reachable here), so the runtime-cpu image carries torch's
CUDA libraries unused.

Every build is cached by its inputs: the base by its packages and trust store, each target under a tag
that hashes the Dockerfile, the files the build context lets in (.dockerignore) and the base's id;
buildah's layer cache keeps the third-party layer when only keepwarm's code changed, and the Dockerfile's
uv cache mount is seeded with this machine's uv cache, so a build downloads nothing already here.

    python -m keepwarm_testing.node.images      # build (or find) every image; prints their names
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .registry import LocalRegistry

ROOT = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "keepwarm" / "images"
SUITE, MIRROR = "bookworm", "http://deb.debian.org/debian"
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")
TRUST_STORE = Path("/etc/ssl/certs/ca-certificates.crt")
CONTEXT = ("api", "runtime", "operator", "scripts/criu")  # what .dockerignore lets into the build context
SKIPPED = ("__pycache__", ".egg-info", "/build/", "/dist/")
TARGETS = ("operator", "runtime-cpu")
# Where buildah keeps a `RUN --mount=type=cache,target=/root/.cache/uv` between builds.
BUILDAH_UV_CACHE = Path("/var/tmp/buildah-cache/root/.cache/uv")
UV_CACHE = Path(os.environ.get("UV_CACHE_DIR", Path.home() / ".cache" / "uv"))


class ImageBuildError(RuntimeError):
    """A build step failed; the message carries the command and its output's tail."""


def run(*args: str, log: Path | None = None) -> str:
    """Run a build command; its output goes to `log` when given (long builds), else is returned."""
    if log is not None:
        with open(log, "ab") as out:
            proc = subprocess.run(args, stdout=out, stderr=subprocess.STDOUT)
        output = log.read_text(errors="replace") if proc.returncode else ""
    else:
        proc = subprocess.run(args, capture_output=True, text=True)
        output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        tail = "\n".join(output.splitlines()[-40:])
        where = f" (log {log})" if log else ""
        raise ImageBuildError(f"{' '.join(args[:4])} ... exited {proc.returncode}{where}:\n{tail}")
    return proc.stdout if log is None else ""


def has_image(name: str) -> bool:
    return (
        subprocess.run(["buildah", "inspect", "--type", "image", name], capture_output=True).returncode == 0
    )


def image_id(name: str) -> str:
    return run("buildah", "inspect", "--type", "image", "--format", "{{.FromImageID}}", name).strip()


def digest_of(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little") + part)
    return h.hexdigest()[:16]


def base_image(log: Path) -> str:
    """The Debian root both bases are made of, built once per package list and trust store."""
    key = digest_of(
        SUITE.encode(), MIRROR.encode(), " ".join(BASE_PACKAGES).encode(), TRUST_STORE.read_bytes()
    )
    name = f"localhost/keepwarm/debian:{SUITE}-{key}"
    if has_image(name):
        return name
    CACHE.mkdir(parents=True, exist_ok=True)
    tarball = CACHE / f"debian-{SUITE}-{key}.tar"
    if not tarball.exists():
        with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
            rootfs = Path(tmp) / "rootfs"
            run(
                "debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
                SUITE, str(rootfs), MIRROR, log=log,
            )  # fmt: skip
            shutil.copyfile(TRUST_STORE, rootfs / TRUST_STORE.relative_to("/"))
            for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
                for path in (rootfs / cache).glob("*"):
                    if path.is_file():
                        path.unlink()
            partial = tarball.with_suffix(".partial")
            run("tar", "-C", str(rootfs), "--numeric-owner", "-cf", str(partial), ".")
            partial.rename(tarball)
    container = run("buildah", "from", "scratch").strip()
    try:
        mount = run("buildah", "mount", container).strip()
        run("tar", "-C", mount, "--numeric-owner", "-xf", str(tarball))
        run("buildah", "umount", container)
        run(
            "buildah", "config",
            "--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "--env", f"SSL_CERT_FILE={TRUST_STORE}",  # pip and uv read it; apt uses the same store
            "--cmd", "/bin/bash", container,
        )  # fmt: skip
        run("buildah", "commit", "--quiet", "--format", "docker", container, name)
    finally:
        run("buildah", "rm", container)
    return name


def pause_image() -> str:
    """The pod sandbox's image: pause.c, linked statically, alone in an image FROM scratch."""
    source = HERE / "pause.c"
    name = f"localhost/keepwarm/pause:{digest_of(source.read_bytes())}"
    if has_image(name):
        return name
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "pause"
        run("gcc", "-static", "-Os", "-s", "-o", str(binary), str(source))
        container = run("buildah", "from", "scratch").strip()
        try:
            run("buildah", "copy", container, str(binary), "/pause")
            run("buildah", "config", "--entrypoint", '["/pause"]', container)
            run("buildah", "commit", "--quiet", "--format", "docker", container, name)
        finally:
            run("buildah", "rm", container)
    return name


def context_files() -> list[Path]:
    """The files a build sees (the .dockerignore allow-list), sorted."""
    files = []
    for top in CONTEXT:
        for path in sorted((ROOT / top).rglob("*")):
            rel = "/" + path.relative_to(ROOT).as_posix() + ("/" if path.is_dir() else "")
            if path.is_file() and not any(s in rel for s in SKIPPED) and not rel.endswith(".pyc"):
                files.append(path)
    return files


def target_tag(target: str, base: str) -> str:
    """A tag naming everything a target's build reads: the Dockerfile, the context, the base's id."""
    parts = [target.encode(), (ROOT / "Dockerfile").read_bytes(), image_id(base).encode()]
    for path in context_files():
        parts += [path.relative_to(ROOT).as_posix().encode(), path.read_bytes()]
    return digest_of(*parts)


def seed_uv_cache() -> None:
    """Point buildah's uv cache mount at this machine's uv cache (downloads already made are reused)."""
    if BUILDAH_UV_CACHE.exists() or BUILDAH_UV_CACHE.is_symlink() or not UV_CACHE.is_dir():
        return
    BUILDAH_UV_CACHE.parent.mkdir(parents=True, exist_ok=True)
    BUILDAH_UV_CACHE.symlink_to(UV_CACHE)


def build_target(target: str, base: str, log: Path) -> str:
    """Build one Dockerfile target (or find it built); returns its local image name."""
    name = f"localhost/keepwarm/{target}:{target_tag(target, base)}"
    if has_image(name):
        return name
    seed_uv_cache()
    drop_older(name)
    run(
        # --force-rm: a failed build leaves no working container (each holds gigabytes) behind.
        "buildah", "bud", "--isolation", "chroot", "--layers", "--force-rm", "--format", "docker",
        "--network", "host",
        "--target", target, "--build-arg", f"PYTHON_IMAGE={base}", "--build-arg", f"DEBIAN_IMAGE={base}",
        # No VCS_REF or BUILD_DATE: a build argument that changes each build misses the cache of every
        # RUN after its ARG (torch's layer included).
        "--build-arg", "TORCH_CPU_INDEX=", "--tag", name, "--file", str(ROOT / "Dockerfile"), str(ROOT),
        log=log,
    )  # fmt: skip
    return name


def drop_older(name: str) -> None:
    """Untag the target's earlier builds and drop the layers only they used (each is several GB): the
    layer cache keeps what a rebuild reuses, as long as the build that reuses it runs right after."""
    repository = name.rsplit(":", 1)[0]
    listing = run("buildah", "images", "--format", "{{.Name}}:{{.Tag}}")
    for old in listing.split():
        if old != name and old.startswith(repository + ":"):
            subprocess.run(["buildah", "rmi", old], capture_output=True)


@dataclass(frozen=True)
class BuiltImages:
    """Local image names (buildah's storage) of everything the real node runs."""

    operator: str
    runtime: str  # the runtime-cpu target: node agent and inference server
    pause: str


def build_images(log: Path | None = None) -> BuiltImages:
    """Build (or find) every image; `log` collects the long builds' output."""
    log = log or Path(tempfile.gettempdir()) / f"keepwarm-images-{os.getuid()}.log"
    base = base_image(log)
    return BuiltImages(
        operator=build_target("operator", base, log),
        runtime=build_target("runtime-cpu", base, log),
        pause=pause_image(),
    )


def push(local: str, registry: LocalRegistry, reference: str) -> str:
    """Push a local image to the registry as `reference` (repository:tag), unless that tag already
    names this very image (same config digest: its id); layers the registry holds are not sent again."""
    if registry.config_digest(reference) == "sha256:" + image_id(local):
        return f"{registry.host}/{reference}"
    run("buildah", "push", "--quiet", "--tls-verify=false", local, f"docker://{registry.host}/{reference}")
    return f"{registry.host}/{reference}"


if __name__ == "__main__":
    built = build_images()
    print(built.operator, built.runtime, built.pause, sep="\n")
    sys.exit(0)
