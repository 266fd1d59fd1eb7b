"""`--dtype auto`: the checkpoint's own dtype, except bfloat16 on CPUs that compute it natively.

A CPU with AMX (``amx_bf16``) or AVX-512 BF16 (``avx512_bf16``) runs bfloat16 matmuls in hardware
(oneDNN uses them), and a decode step there is bound by reading the weights, which bfloat16 halves:
on a 2-core machine with AMX, keepwarm's offline throughput was 1.76x float32's (issue 16).
Elsewhere bfloat16 on a CPU is emulated and a float32 checkpoint is best left float32, so auto keeps
what the checkpoint was saved in (``dtype``, or the older ``torch_dtype``, in config.json; a multimodal
config's ``text_config``); a checkpoint that names none is float32, as transformers loads it.

The decision (``choose_dtype``) is a pure function of the checkpoint's dtype, the CPU's flags and the
device, tested on its own; the readers of config.json and /proc/cpuinfo are the edges. No torch here:
`keepwarm serve` resolves auto before it imports the engine.
"""

from __future__ import annotations

import json
from pathlib import Path

from keepwarm_api.values import SERVING_DTYPES

AUTO_DTYPE = "auto"  # the --dtype value this module resolves
CHECKPOINT_DEFAULT = "float32"  # no dtype in config.json: transformers loads float32
BF16_CPU_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})  # /proc/cpuinfo flags of native bfloat16
CPUINFO = Path("/proc/cpuinfo")


def parse_cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The flags of /proc/cpuinfo's first ``flags`` line (x86; other CPUs have none: an empty set)."""
    return frozenset(cpuinfo_field(cpuinfo, "flags").split())


def cpuinfo_field(cpuinfo: str, name: str) -> str:
    """The first processor's ``name`` field of /proc/cpuinfo's text ("" where it has none), e.g.
    ``vendor_id``: GenuineIntel, AuthenticAMD."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == name:
            return value.strip()
    return ""


def this_cpu(name: str) -> str:
    """This machine's ``name`` field of /proc/cpuinfo ("" where absent or unreadable)."""
    try:
        return cpuinfo_field(CPUINFO.read_text(), name)
    except OSError:
        return ""


def cpu_vendor() -> str:
    """This machine's CPU vendor as /proc/cpuinfo's ``vendor_id`` names it ("" where unreadable)."""
    return this_cpu("vendor_id")


def config_dtype(config: dict) -> str | None:
    """The dtype a config.json names, as the engine spells it; None when it names none we serve."""
    for holder in (config, config.get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            value = holder.get(key)
            if value in SERVING_DTYPES:
                return value
    return None


def choose_dtype(checkpoint: str | None, cpu_flags: frozenset[str], device: str) -> tuple[str, str]:
    """(dtype, why) for ``--dtype auto``: bfloat16 on a CPU with native bfloat16, else the checkpoint's."""
    native = sorted(cpu_flags & BF16_CPU_FLAGS)
    if device == "cpu" and native:
        return "bfloat16", f"the CPU computes bfloat16 natively ({', '.join(native)})"
    if checkpoint is None:
        return CHECKPOINT_DEFAULT, f"the checkpoint names no dtype ({CHECKPOINT_DEFAULT}, as transformers)"
    return checkpoint, "the checkpoint's dtype"


def auto_dtype(model_dir: str | Path, device: str | None) -> tuple[str, str]:
    """(dtype, why) for ``--dtype auto``: reads config.json and, on a CPU, /proc/cpuinfo."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        config = {}  # the engine refuses an unreadable checkpoint by name when it loads it
    device = device or "cpu"  # the engine's default device
    flags = parse_cpu_flags(CPUINFO.read_text()) if device == "cpu" and CPUINFO.exists() else frozenset()
    return choose_dtype(config_dtype(config), flags, device)
