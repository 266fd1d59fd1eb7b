"""The GPU run's steps, in the order they run, each with its time box; one list for the run and the dry run.

Steps run most-valuable first under one deadline (BUDGET_S): a step gets min(its ceiling, time left)
and is skipped once less than half its ceiling is left, so a slow early step costs the last ones,
never the whole run. Steps past the budget line run only when earlier ones finish early; rerun any
step by name with ``scripts/gpu-check --only NAME,...``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

BUDGET_S = 510  # the whole run, unpacking excluded: leaves a 15-minute lease time to rerun a part
DEVICE_TIMEOUT_S = 570  # timeout_s of the device call: BUDGET_S + unpacking + margin
PY = "{py}"  # replaced by the interpreter running gpu-check
# the flashinfer throughput run's peers: transformers, keepwarm without decode graphs, steps one at a time
PEERS = "generate,keepwarm_eager,keepwarm_one_at_a_time"
WORK = "{work}"  # replaced by the run's scratch folder (bundled into the results)


@dataclass(frozen=True)
class Step:
    name: str
    argv: list[str]  # with {py} / {work} placeholders
    ceiling_s: int  # the step's own time box
    kind: str  # "pytest" (junit xml in {work}) | "json" (stdout is one JSON document) | "text"
    imports: list[str] = field(default_factory=list)  # modules the step needs: the dry run imports them
    help_argv: list[str] | None = None  # argv that prints the step's --help (flags checked in the dry run)
    core: bool = True  # inside the budget line; False: runs only if time is left
    gate: bool = False  # when it fails, nothing after it can pass: the run stops
    env: dict[str, str] = field(default_factory=dict)  # set for this step only (e.g. an opt-in)
    # Dotted keys its JSON result must hold (the smoke twins: a case that silently did not run fails).
    expect: tuple[str, ...] = ()

    def command(self, py: str, work: str) -> list[str]:
        return [a.replace(PY, py).replace(WORK, work) for a in self.argv]

    def flags(self) -> list[str]:
        return [a for a in self.argv if a.startswith("--")]


ENGINE_MODULES = [
    "keepwarm_runtime.engine.llm",
    "keepwarm_runtime.engine.attention.flashinfer_backend",
    "keepwarm_runtime.modelgen",
    "transformers.models.llama.modeling_llama",
    "transformers.models.gemma2.modeling_gemma2",
    "transformers.models.deepseek_v3.modeling_deepseek_v3",
]
CACHE_MODULES = [
    "keepwarm_runtime.cache.client",
    "keepwarm_runtime.cache.daemon",
    "keepwarm_runtime.cache.backends.cuda",
    "keepwarm_runtime.cache.gpus",
    "keepwarm_runtime.cache.cli",
    "keepwarm_runtime.cli",
]
# What a `keepwarm serve` process imports: server/cli.py's check() (base/media_fetch,
# openai/audio/serving), then run() (uvicorn, the app and its error
# handlers); the carried web stack (manifest.CARRIED) serves them.
SERVER_MODULES = [
    "keepwarm_runtime.server.cli",
    "keepwarm_runtime.server.base.media_fetch",
    "keepwarm_runtime.server.openai.audio.serving",
    "keepwarm_runtime.server.base.errors",
    "keepwarm_runtime.server.app",
    "keepwarm_runtime.server.base.serving",
    "uvicorn",
]
RESTART_HELP = [PY, "-m", "keepwarm_runtime.cli", "bench", "restart", "--help"]
THROUGHPUT_HELP = [PY, "bench/throughput.py", "--help"]
STEP_HELP = [PY, "bench/step.py", "--help"]
MOE_HELP = [PY, "bench/moe.py", "--help"]
ENV_SCRIPT = "scripts/gpucheck/envinfo.py"
SNAPSHOT_MODULES = ["keepwarm_runtime.snapshot.restore", "keepwarm_runtime.snapshot.service"]
# run by their own steps
OTHER_TESTS = [
    "--ignore=tests/gpu/cache", "--ignore=tests/gpu/engine", "--ignore=tests/gpu/lora",
    "--ignore=tests/gpu/parallel", "--ignore=tests/gpu/snapshot", "--ignore=tests/gpu/graphs",
]  # fmt: skip
# tensor/expert parallel (engine/parallel): torch.distributed with NCCL, and the gpu-tier shards
PARALLEL_MODULES = [
    "torch.distributed",
    "keepwarm_runtime.engine.parallel.group",
    "keepwarm_runtime.engine.parallel.launch",
    "keepwarm_runtime.engine.parallel.runner",
    *CACHE_MODULES,
]
LORA_MODULES = ["peft", "keepwarm_runtime.engine.lora.slots", "keepwarm_runtime.cache.backends.cuda"]
# tests/gpu/moe's FlashInfer fused-MoE parity cases (CUTLASS FP8 block-scale and bf16, SwiGLU with
# alpha/beta/limit, biases; the flashinfer_cutlass expert layout served zero-copy from a gpu-tier
# arena) run only with this set: their first call JIT-compiles for minutes.
FLASHINFER_MOE_OPT_IN = "KEEPWARM_GPU_FLASHINFER_MOE"
MOE_MODULES = [
    "keepwarm_runtime.engine.moe.experts",
    "keepwarm_runtime.engine.moe.flashinfer_backend",
    "keepwarm_runtime.weights.kernel_layout",
]


def _pytest(
    name: str,
    path: str,
    ceiling_s: int,
    imports: list[str],
    *select: str,
    core: bool = True,
    env: dict[str, str] | None = None,
    per_test_s: int = 45,
) -> Step:
    """pytest verbose (the output names the test that ran last), each test stopped at `per_test_s` with
    its stack (pytest-timeout) so that one stuck test leaves the step's time to the others."""
    argv = [PY, "-m", "pytest", path, *select, "-v", "-rA", "-p", "no:cacheprovider"]
    argv += [f"--junitxml={WORK}/{name}.xml", f"--timeout={min(per_test_s, ceiling_s)}"]
    return Step(name, argv, ceiling_s, "pytest", imports, core=core, env=env or {})


def _restart(
    size_gib: int, dtype: str, ceiling_s: int, core: bool = True, serve: bool = False, snapshot: bool = False
) -> Step:
    """The restart benchmark on cuda:0. Without `serve` it times the engine paths only (--no-serve);
    `serve` adds whole `keepwarm serve` starts timed to /ready (from disk and attached from the cache),
    whose web stack (fastapi, starlette, uvicorn, pydantic) the image lacks and the archive carries;
    `snapshot` adds whole starts in a pod's namespaces restored from a snapshot beside importing ones
    (root, CRIU on PATH)."""
    argv = [PY, "-m", "keepwarm_runtime.cli", "bench", "restart", "--size-gib", str(size_gib)]
    argv += ["--serving-dtype", dtype, "--device", "cuda:0", "--repeats", "1", "--threads", "0", "--json"]
    argv += [] if serve else ["--no-serve"]
    argv += ["--snapshot", "--criu", "criu"] if snapshot else []
    short = {"bfloat16": "bf16", "float32": "f32"}[dtype]
    suffix = ("-serve" if serve else "") + ("-snapshot" if snapshot else "")
    return Step(
        f"restart-{size_gib}gib-{short}{suffix}",
        argv,
        ceiling_s,
        "json",
        ["bench.restart", *CACHE_MODULES, *(SERVER_MODULES if serve or snapshot else [])],
        RESTART_HELP,
        core,
        expect=("snapshot.snapshot_ready_s", "snapshot.imports_ready_s") if snapshot else (),
    )


def _throughput(backend: str, ceiling_s: int, core: bool = True, skip_hf: bool = False) -> Step:
    """The 100M bfloat16 64 x 128 run; FlashInfer's beside itself with --enforce-eager (keepwarm_eager)
    and with steps one at a time (keepwarm_one_at_a_time): decode graphs against eager steps, overlapped
    steps against landed ones, in one run (issue 35's goal: >= 25,000 tokens/s)."""
    argv = [PY, "bench/throughput.py", "--params", "100M", "--dtype", "bfloat16", "--device", "cuda:0"]
    argv += ["--prompts", "64", "--output-tokens", "128", "--rounds", "2", "--threads", "4"]
    argv += ["--attention-backend", backend, *(["--skip-hf"] if skip_hf else [])]
    argv += ["--peers", PEERS] if backend == "flashinfer" and not skip_hf else []
    return Step(f"throughput-{backend}", argv, ceiling_s, "json", ENGINE_MODULES, THROUGHPUT_HELP, core)


def _decode_step(ceiling_s: int) -> Step:
    """bench/step.py on cuda:0: a decode step's whole time, its synchronised forward pass and the host's
    share, at batch 1/16/64/256 on the 10M and 100M models in bfloat16 with FlashInfer (issue 35's
    split of the H200's 20 ms steps into device and Python time)."""
    argv = [PY, "bench/step.py", "--device", "cuda:0", "--dtype", "bfloat16", "--params", "10M,100M"]
    argv += ["--attention-backend", "flashinfer", "--threads", "4", "--steps", "16"]
    return Step("step-decode-flashinfer", argv, ceiling_s, "json", ENGINE_MODULES, STEP_HELP, core=False)


def _moe(flashinfer: bool, ceiling_s: int) -> Step:
    argv = [PY, "bench/moe.py", "--device", "cuda:0", "--experts", "16", "--hidden", "2048"]
    argv += ["--intermediate", "1024", "--repeats", "5", *([] if flashinfer else ["--skip-flashinfer"])]
    name = "moe-layer-flashinfer" if flashinfer else "moe-layer-torch"
    return Step(name, argv, ceiling_s, "json", MOE_MODULES, MOE_HELP, False)


# Boxes from the GPU runs (2026-12-04, H200, two sessions): the image's first imports are slow (env
# 14-16 s), every restart case spawns four Python processes (the 1 GiB one took 100 s, its serve
# variant 92 s), each GPU cache test starts its own daemon (10 tests: 145 s), and FlashInfer
# JIT-compiles one module per dtype and head size (about 27 s each; its 4 parity tests took 138 s).
# Core, first: what has never passed on a GPU (LoRA, FlashInfer throughput, the MoE tests), then the
# cheapest regression check. Past the line: the steps that passed (tests-cache, tests-flashinfer,
# both 1 GiB restarts, tests-engine-torch) and the larger restarts, run when time is left or by name.
STEPS: list[Step] = [
    Step("env", [PY, ENV_SCRIPT], 25, "json", ["torch", "transformers", "flashinfer"], gate=True),
    # Decode steps from CUDA graphs and overlapped steps (issue 35), never run on a GPU yet (written
    # without one): capture (on a step and while idle) and replay on FlashInfer's CUDA-graph decode
    # wrapper against --enforce-eager, steps overlapped against one at a time, Gemma 2's eager fallback.
    # A guess: FlashInfer's JIT for float16 (about 27 s a module) and twelve small engines.
    _pytest(
        "tests-decode-graphs",
        "tests/gpu/graphs",
        165,
        ENGINE_MODULES,
        per_test_s=120,
    ),
    # LoRA on CUDA: PEFT parity of a mixed batch, adapters from a gpu-tier daemon (never run yet: a
    # guess of two engines, PEFT on the CPU and one daemon start).
    _pytest("tests-lora", "tests/gpu/lora", 120, LORA_MODULES, per_test_s=90),
    # Cut at 60 s inside the transformers baseline, then at 135 s after keepwarm's two JIT builds
    # (about 55 s) while the baseline ran; the bench now prints each round as it ends.
    _throughput("flashinfer", 200),
    # Past the budget line: run when the steps above finish early, or by name in a rerun.
    # Never run yet: FlashInfer's JIT (about 27 s per module) plus two engines and 4 x 40 steps each.
    _decode_step(120),
    # Any other GPU tests (tests/gpu/moe, ...): none yet is "empty", not a failure. Cut at 90 s with
    # 4 passed and 3 skipped in the first run; past the line since the decode graphs' step came in.
    _pytest("tests-gpu-other", "tests/gpu", 140, [], *OTHER_TESTS, core=False),
    # Tensor/expert parallel, never run on a GPU yet (written without one): the NCCL path at world
    # size 1 on any lent GPU; the 2-GPU groups and gpu-tier shards skip, naming why, on one GPU. A
    # guess: two engines per case (one rank, the group), each rank a fresh process importing torch.
    _pytest(
        "tests-parallel-nccl",
        "tests/gpu/parallel",
        150,
        PARALLEL_MODULES,
        "-k",
        "group_of_one",
        core=False,
        per_test_s=120,
    ),
    _pytest(
        "tests-parallel-multi-gpu",
        "tests/gpu/parallel",
        200,
        PARALLEL_MODULES,
        "-k",
        "not group_of_one",
        core=False,
        per_test_s=120,
    ),
    _pytest("tests-cache", "tests/gpu/cache", 150, CACHE_MODULES, core=False),
    _pytest(
        "tests-flashinfer",
        "tests/gpu/engine",
        200,
        ENGINE_MODULES,
        "-k",
        "flashinfer",
        core=False,
        per_test_s=120,
    ),
    _restart(1, "bfloat16", 120, core=False),
    # The 1 GiB restart again with two whole server starts (disk, cache): each a fresh process that
    # imports torch, transformers and the web stack, on top of the engine paths' 120 s box.
    _restart(1, "bfloat16", 150, core=False, serve=True),
    _pytest("tests-engine-torch", "tests/gpu/engine", 60, ENGINE_MODULES, "-k", "not flashinfer", core=False),
    # Process snapshots on CUDA (never run on a GPU yet; needs root and CRIU on the device machine: the
    # runtime image's /usr/local/sbin/criu, or scripts/criu/build.sh's): the CUDA parent's preload,
    # and a pod restored from a snapshot serving on CUDA; then `keepwarm serve` from a snapshot to
    # ready at 1 GiB (goal: snapshot_ready_s <= 3 s; imports_ready_s beside it).
    _pytest("tests-snapshot", "tests/gpu/snapshot", 240, SNAPSHOT_MODULES, core=False, per_test_s=200),
    _restart(1, "bfloat16", 240, core=False, snapshot=True),
    _restart(16, "bfloat16", 180, core=False),  # includes writing the 16 GiB checkpoint (reused by f32)
    _restart(1, "float32", 60, core=False),
    _restart(16, "float32", 90, core=False),
    _throughput("torch", 50, core=False, skip_hf=True),
    _restart(4, "bfloat16", 50, core=False),
    _restart(4, "float32", 40, core=False),
    _moe(flashinfer=False, ceiling_s=40),
    _moe(flashinfer=True, ceiling_s=120),  # compiles the CUTLASS MoE kernels on first use
    # FlashInfer fused-MoE parity against the torch reference, after the bench has warmed the JIT cache.
    _pytest(
        "tests-flashinfer-moe",
        "tests/gpu/moe",
        240,
        MOE_MODULES,
        "-k",
        "flashinfer",
        core=False,
        env={FLASHINFER_MOE_OPT_IN: "1"},
        per_test_s=200,
    ),
]


def select(names: list[str] | None) -> list[Step]:
    """The steps to run: all, or those named (in plan order); an unknown name is an error."""
    if not names:
        return list(STEPS)
    known = {s.name for s in STEPS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown step(s) {', '.join(unknown)}; steps: {', '.join(sorted(known))}")
    return [s for s in STEPS if s.name in names]


def core_ceiling_s(steps: list[Step]) -> int:
    return sum(s.ceiling_s for s in steps if s.core)


def time_box(step: Step, left_s: float) -> float | None:
    """Seconds this step may run with `left_s` left in the budget, or None: skip it (under half its box)."""
    if left_s < step.ceiling_s / 2:
        return None
    return min(float(step.ceiling_s), left_s)


# CPU twins of the benchmark steps for `--dry-run --smoke`: the same code paths at toy size, under the
# GPU image's package set, so an import made lazily inside a function fails here, not on the GPU.
SMOKE_PYTEST = ["-p", "no:cacheprovider", "tests/integration/engine/test_llm.py"]
SMOKE_PYTEST += ["tests/integration/engine/test_decode_graphs.py"]  # tests-decode-graphs' twins
SMOKE_PYTEST += ["tests/integration/engine/test_overlap.py"]
SMOKE_RESTART = ["--size-gib", "0.02", "--serving-dtype", "float32", "--device", "cpu", "--repeats", "1"]
# the GPU step's peers: vLLM's CPU build, where this machine has one, is no part of the GPU run
SMOKE_THROUGHPUT = ["--params", "1M", "--prompts", "4", "--output-tokens", "4", "--rounds", "1"]
SMOKE_THROUGHPUT += ["--peers", PEERS]
SMOKE_STEP = ["--params", "1M", "--batches", "1,4", "--steps", "2", "--warmup", "1", "--device", "cpu"]
SMOKE_STEPS: list[Step] = [
    # tests/gpu/engine's CPU twin: greedy parity with transformers on every tested architecture, and
    # tests/gpu/graphs': the padded decode steps the graphs replay, run eagerly
    Step("smoke-engine-parity-cpu", [PY, "-m", "pytest", "-q", *SMOKE_PYTEST], 300, "pytest"),
    # restart-1gib-bf16-serve's twin: two whole `keepwarm serve` processes (from disk, attached from the
    # cache) started and timed to /ready under the image's packages plus the carried web stack.
    Step(
        "smoke-restart-cpu",
        [*RESTART_HELP[:-1], *SMOKE_RESTART, "--threads", "1", "--json"],
        300,
        "json",
        expect=(
            "serve.disk_warm.wall_to_ready_s",
            "serve.cache.wall_to_ready_s",
            "serve.cache.weights_source",
        ),
    ),
    # step-decode-flashinfer's twin: the same script on CPU at toy size
    Step("smoke-step-cpu", [*STEP_HELP[:-1], *SMOKE_STEP, "--threads", "1"], 300, "json"),
    Step(
        "smoke-throughput-cpu",
        [*THROUGHPUT_HELP[:-1], *SMOKE_THROUGHPUT, "--threads", "1", "--device", "cpu"],
        300,
        "json",
    ),
]
