"""keepwarm's compiled CPU kernels (csrc/): built on first use, cached, loaded into torch.ops.

One library, ``torch.ops.keepwarm_cpu``: the paged decode attention (csrc/paged_decode.cpp), the
fused RMSNorm, SiLU-and-mul and rotary kernels (csrc/fused_ops.cpp, attached by engine/cpu_fused.py),
the bfloat16 linear layer on AMX tiles with its gated-MLP form (csrc/amx_linear.cpp, used by
engine/cpu_linear.py and engine/cpu_fused.py) and the float32 and bfloat16 linear layers on AVX-512 for
steps of few tokens (csrc/avx512_linear.cpp, used by engine/cpu_linear.py).
The kernels are compiled for this machine's CPU (`-march=native`) with the compiler torch's extension
builder finds, once, into torch's extension cache (``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``); later processes load the cached library in milliseconds. The library
name carries a hash of the sources (and the csrc/*.h they include), the torch and Python
versions and the CPU's instruction-set flags, so a cache shared between machines or images never hands
one CPU (or torch) another's build, and a process finding that build loads it directly, without
importing the builder. `make venv` builds it
ahead (`python -m keepwarm_runtime.engine.attention.native`), so no server or test compiles it; the
runtime image does not (it has no compiler, and a build is only good for the CPU it was made on), so
CPU pods of that image run the torch backend.

On a node, the agent pod of a host-tier WeightCache builds it once (``--optional``: a node without a
compiler only logs why) into the node's kernel folder, which CPU runtime pods mount read-only and name
in ``KEEPWARM_KERNEL_CACHE`` (keepwarm_api.podenv; `keepwarm serve --kernel-cache`, resolved by its
settings into EngineConfig.kernel_cache and passed to ``load``): a build found there is loaded first,
so a fresh pod does not compile, and no pod can write what another loads. A miss there builds as above.
Nothing here reads KEEPWARM_* variables; ``main`` resolves its own setting at its entry point.

It links the OpenMP runtime torch already loaded (the same soname), so its threads are torch's
intra-op threads, under the same count and spin settings (engine/threads.py).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from keepwarm_api.settings import add_arguments, resolve, setting

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(
    CSRC / name for name in ("paged_decode.cpp", "fused_ops.cpp", "amx_linear.cpp", "avx512_linear.cpp")
)
HEADERS = (CSRC / "vec16.h", CSRC / "linear_operands.h")  # included by the sources: in the build's name
CFLAGS = ("-O3", "-march=native", "-fopenmp")
OP_NAMESPACE = "keepwarm_cpu"

_lock = threading.Lock()
_loaded: str | None = None  # the library name once loaded in this process


class KernelUnavailable(RuntimeError):
    """The CPU kernel cannot be built or loaded here; the message says why."""


_failed: KernelUnavailable | None = None  # why the build failed in this process, once it has


def library_name() -> str:
    """Names a build by its sources, the torch and Python it links and this CPU's instruction sets (a
    build is only good for all of them)."""
    digest = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        digest.update(source.read_bytes())
    digest.update(" ".join(CFLAGS).encode())
    digest.update(f"torch {torch.__version__} python {sys.version_info[:2]}".encode())
    digest.update(_cpu_flags().encode())
    return f"keepwarm_cpu_{digest.hexdigest()[:12]}"


def _cpu_flags() -> str:
    return " ".join(sorted(cpu_flags())) or "unknown"


def cpu_flags() -> set[str]:
    """This CPU's instruction-set flags as /proc/cpuinfo names them (empty where it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _node_build(name: str, root: str | Path | None) -> Path | None:
    """The node agent's build of ``name`` in ``root`` (the kernel cache folder, laid out as the builder
    lays out TORCH_EXTENSIONS_DIR), if there is one."""
    path = Path(root) / name / f"{name}.so" if root else None
    return path if path is not None and path.is_file() else None


def _built_library(name: str) -> Path | None:
    """The cached build of ``name`` where torch's extension builder puts it, if it is there.

    Its name carries the source and CPU hash, so a file there is this kernel for this CPU; loading it
    directly skips importing the builder (setuptools, ~0.2 s) and its ninja run on every start. The
    folder is torch's (``cpp_extension._get_build_directory``; a test checks the two agree); a miss or
    a ROCm build goes to the builder."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        from torch import _appdirs  # a submodule torch does not import itself

        if torch.version.hip is not None:
            return None
        accelerator = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(
            os.path.realpath(_appdirs.user_cache_dir(appname="torch_extensions")),
            f"{python}_{accelerator}",
        )
    path = Path(root) / name / f"{name}.so"
    return path if path.is_file() else None


def load(kernel_cache: str | Path | None = None) -> str:
    """Build (when this CPU has no cached build) and load the kernel; idempotent, thread-safe.

    ``kernel_cache``: a read-only folder of builds (the node agent's) tried first.
    Returns the library name. Raises KernelUnavailable with the compiler's last lines on failure, and
    the same error again on later calls that find no build to load, without building again: the engine
    asks from several places (attention backend, fused kernels, AMX linears), and in an image without a
    compiler each failed build would cost the start its time once more. A build that is there (a
    node's, named by a later call's ``kernel_cache``) is still loaded."""
    global _loaded, _failed
    with _lock:
        if _loaded is not None:
            return _loaded
        name = library_name()
        started = time.perf_counter()
        for built in (_node_build(name, kernel_cache), _built_library(name)):
            if built is None:
                continue
            try:
                torch.ops.load_library(str(built))
            except OSError as exc:  # a torn or foreign build: the next one, or the builder, redoes it
                log.warning("CPU attention kernel %s did not load (%s)", built, exc)
            else:
                log.info(
                    "CPU attention kernel %s loaded from %s in %.2fs",
                    name,
                    built.parent,
                    time.perf_counter() - started,
                )
                _loaded = name
                return name
        if _failed is not None:  # the builder already failed in this process
            raise _failed
        from torch.utils import cpp_extension

        try:
            cpp_extension.load(
                name=name,
                sources=[str(source) for source in SOURCES],
                extra_cflags=list(CFLAGS),
                is_python_module=False,
            )
        except Exception as exc:  # a missing compiler, an unwritable cache, a failed build
            lines = [line for line in str(exc).splitlines() if line.strip()]
            _failed = KernelUnavailable(f"{type(exc).__name__}: {' | '.join(lines[-3:])[:400]}")
            raise _failed from exc
        log.info("CPU attention kernel %s loaded in %.2fs", name, time.perf_counter() - started)
        _loaded = name
        return name


@functools.cache
def op(name: str) -> torch._ops.OpOverload:
    """The loaded library's operator ``name`` (its one overload), looked up once: a decode step calls
    these kernels hundreds of times, and each lookup through ``torch.ops`` and the overload packet cost
    about 1 us of Python (10M Llama, one token a step: some 60 linear layers). A lookup before
    ``load`` raises, and is not cached."""
    return getattr(getattr(torch.ops, OP_NAMESPACE), name).default


def paged_decode_attention(
    out: torch.Tensor,  # [B, H, Dv], written
    query: torch.Tensor,  # [B, H, Dk]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, Dk]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, Dv]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    starts: torch.Tensor,  # [B] int64: first key each query sees
    ends: torch.Tensor,  # [B] int64: one past its last key
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,  # [H] float32 sink logits
) -> None:
    op("paged_decode_attention")(
        out, query, k_cache, v_cache, block_tables, starts, ends, scale, softcap or 0.0, sinks
    )


def write_kv(
    cache: torch.Tensor,  # [slots, Hkv, D] contiguous, written
    slots: torch.Tensor,  # [T] int64
    rows: torch.Tensor,  # [T, Hkv, D], the last dim contiguous
) -> None:
    op("write_kv")(cache, slots, rows)


def amx_linear_available() -> bool:
    """The loaded build has the AMX linear kernel and Linux granted this process the tile state."""
    return bool(getattr(torch.ops, OP_NAMESPACE).amx_linear_available())


def amx_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for bfloat16 on AMX, the weight read in place (csrc/amx_linear.cpp);
    needs K % 32 == 0 and N % 16 == 0."""
    return op("amx_linear")(x, weight, bias)


def amx_gate_up_silu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu_and_mul(F.linear(x, gate), F.linear(x, up))`` on AMX in one pass, the same bits as those
    three (csrc/amx_linear.cpp); gate and up [N, K] with K % 32 == 0 and N % 16 == 0."""
    return op("amx_gate_up_silu")(x, gate, up)


def f32_linear_available() -> bool:
    """The loaded build has the float32 AVX-512 linear kernel (it was compiled for a CPU with AVX-512)."""
    return bool(getattr(torch.ops, OP_NAMESPACE).f32_linear_available())


def f32_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for float32 on AVX-512, the weight read in place and the output
    written in rows (csrc/avx512_linear.cpp); needs N % 4 == 0."""
    return op("f32_linear")(x, weight, bias)


def bf16_linear_available() -> bool:
    """The loaded build has the bfloat16 AVX-512 linear kernel (compiled for a CPU with AVX-512 BF16)."""
    return bool(getattr(torch.ops, OP_NAMESPACE).bf16_linear_available())


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for bfloat16 on AVX-512 BF16 without AMX tiles, the weight read in
    place (csrc/avx512_linear.cpp); needs N % 4 == 0."""
    return op("bf16_linear")(x, weight, bias)


@dataclass(frozen=True)
class BuildSettings:
    """``main``'s settings (flag, else variable, else default: keepwarm_api.settings)."""

    kernel_cache: str | None = setting(
        None, "read-only folder of builds (a node agent's) to load before building one", metavar="DIR"
    )


def parser() -> argparse.ArgumentParser:
    """The command line of ``main`` (the agent pod's init container runs it: builders/agent.py)."""
    p = argparse.ArgumentParser(prog="python -m keepwarm_runtime.engine.attention.native")
    p.add_argument("--optional", action="store_true", help="exit 0 when the kernel cannot be built")
    add_arguments(p, BuildSettings)
    return p


def main(argv: list[str] | None = None) -> int:
    """Build the kernel now (image builds, `make venv`, the agent pod), so no serving process compiles
    it. ``--optional`` (the agent pod): a machine that cannot build it says why and exits 0."""
    args = parser().parse_args(argv)
    settings = resolve(BuildSettings, args)  # KEEPWARM_KERNEL_CACHE unless --kernel-cache
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(load(settings.kernel_cache))
    except KernelUnavailable as exc:
        print(f"keepwarm: the CPU attention kernel cannot be built here: {exc}", file=sys.stderr)
        return 0 if args.optional else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
