"""Linear layers on CPU: float32 steps of few tokens on keepwarm's AVX-512 kernel or taken
weight-major, bfloat16 on AMX tiles, on keepwarm's AVX-512 kernel or on a packed weight.

**float32, AVX-512.** A decode step's few rows make each layer a pass over its weight, which MKL's
sgemm streamed from memory at about a third of one thread's sequential rate once the weights left the
caches (the 100M Llama's projections, one thread, Xeon with AVX-512: 7 GB/s at 16 rows). Where
keepwarm's CPU library has it (a build for a CPU with AVX-512), steps of 1 to MAX_ROWS tokens take
keepwarm's kernel (csrc/avx512_linear.cpp): dot products along the weight's rows as they lie, the next
rows prefetched while a block computes, the output written in rows. The 100M Llama's seven
projections, more of them than the L3 cache holds: 1.6-2.4x faster than the weight-major product at
2-16 rows, 1.3x at 32-64, 1.08x at 128 (`bench/cpu_linear.py --dtype float32`). Its sums run in a
fixed order that depends only on the layer's input width, so a token's result does not depend on the
other tokens of its step; it differs from MKL's by float32 rounding (about 1e-6 relative). Short rows
(under F32_SHORT_ROW input features) over more than F32_SHORT_ROW_TOKENS tokens stay with MKL's
``F.linear`` (below). ``--no-cpu-f32-linear`` turns it off.

**float32, weight-major.** Without the kernel, ``F.linear(x, W)`` with ``x`` [M, in] and ``W``
[out, in] reaches MKL's sgemm with the few rows of ``x`` as the left operand; for M from 2 to about 128
(a short prompt's prefill, a decode step of a handful of sequences) that call was 1.2-2.5x slower on a
2-core AVX2 VM than the same product taken weight-major, ``(W @ x.T).T``, which streams ``W`` once as a
tall-skinny GEMM (5632x2048, M=4: 8.0 ms vs 3.2 ms; at M=1 both run as a GEMV). bfloat16 was slower
that way, so only float32 layers change. The sums are the same up to fp32 rounding order (about 1e-6
relative), as between any two batch sizes of ``F.linear`` itself. Layers keep their class's behaviour
otherwise: LoRA's forward hooks, ``isinstance(m, nn.Linear)`` and state dicts see an ``nn.Linear``.

**bfloat16, packed.** On a CPU with native bfloat16 (AVX-512 BF16, AMX), ``F.linear`` reaches oneDNN,
which reorders the weight into its blocked layout on every call. Reordered once and kept (oneDNN's
"packed" weight, as vLLM's CPU path and Inductor keep it), the same products took 1.2-2.1x less time
for 4-256 rows (Xeon with amx_bf16, one thread: 2048x8192 at 16 rows 2.74 -> 1.29 ms, at 64 rows
3.82 -> 2.34 ms; at 1 row and at 1,024 the same), bit for bit the same result: the same oneDNN
primitive on the same weight layout. A one-row step keeps ``F.linear``, whose one-row kernel rounds
differently, so a step's result never depends on whether its layer is packed yet. The packed copy is
private memory beside the attached weights (as much again as the linear layers), and reordering costs
about 0.6 ms per MiB, so ``LinearPacker`` packs them in a background thread after load (and after a wake),
at the lowest CPU priority so that it takes no time from steps: until a layer is packed it computes as
before. A layer whose weight moved (sleep, wake) drops its packed copy. ``--no-cpu-packed-weights``
turns it off.

**bfloat16, AMX.** A decode step's few rows make a layer bound by reading its weight, which oneDNN's
packed kernels did at about half of one thread's sequential rate. On a CPU with AMX, steps of up to
AMX_MAX_ROWS tokens take keepwarm's kernel instead (csrc/amx_linear.cpp): it loads the weight's tiles
where the weight lies (the attached, shared copy: nothing to pack, so the first step after a start is
as fast as the rest) and prefetches the next rows while the tiles multiply. The 100M Llama's seven
projections in 40 copies (more than the L3 cache, as in a step; `bench/cpu_linear.py`), one thread,
Xeon with amx_bf16: 1.27-1.39x faster than oneDNN on its packed weight at 1-32 rows, 1.08-1.14x at
48-64, the same at 128; steps of over AMX_MAX_ROWS rows (prefill chunks) are compute-bound and stay on
oneDNN. Sums run in float32 in another order than oneDNN's, so an output may differ from
``F.linear``'s by one bfloat16 ulp (about 1 in 10,000 on the tests' shapes).
A gated MLP's gate and up projections and its SiLU-and-mul are one AMX operator where both layers
would take the kernel and no hook watches them (``gate_up_silu``, called by engine/cpu_fused.py): the
same bits, the activation rearranged once and no intermediate written out and read back.
``--no-cpu-amx-linear`` turns it off.

**bfloat16, AVX-512 BF16.** A CPU with AVX-512 BF16 but no AMX tiles (a Xeon whose hypervisor hides
AMX, AMD Zen 4 and 5) left decode steps to oneDNN's packed weight, read at 9-10 GB/s for one row and,
from 16 rows, held to VDPBF16PS's rate (about 75 GFLOPS, where float32 FMAs make 175 on the Xeon
measured). Every bfloat16 step takes keepwarm's AVX-512 kernel there instead (csrc/avx512_linear.cpp,
the float32 kernel's loops): the weight read where it lies, each line widened to float32 in registers
and multiplied with FMAs, the next rows prefetched. The 100M Llama's projections, one thread, Xeon with
avx512_bf16 and no AMX: 1.24-1.25x faster than oneDNN on its packed weight at 1-2 rows, 1.37-1.52x at
8-128, 1.13-1.34x at 256-2,048 (prefill chunks; `bench/cpu_linear.py`), so those layers keep no packed
copy (as much private memory again as the linear layers). Not so where VDPBF16PS retires at the FMA's
rate (AMD's Zen 4 and 5: FAST_DOT_VENDORS): there oneDNN's packed weight was 2.6-2.9x faster than the
kernel from 16 rows, so the kernel takes steps of up to FAST_DOT_KERNEL_MAX_ROWS rows and the layers
are packed for the rest. Sums run in float32 in
an order that depends only on K, so a token's outputs do not depend on the other tokens of its step
and may differ from ``F.linear``'s by one bfloat16 ulp, as the AMX kernel's may. On a CPU with AMX,
bfloat16 stays with the AMX kernel and oneDNN (this kernel was measured without AMX only).
``--no-cpu-bf16-linear`` turns it off.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from keepwarm_runtime.engine.attention import native
from keepwarm_runtime.engine.auto_dtype import cpu_vendor

log = logging.getLogger(__name__)

# Rows (tokens in the step) for which the weight-major product and the float32 kernel won in the
# measurements above (the kernel from 1 row: as fast as MKL's GEMV there); larger steps are prefill
# chunks, compute-bound, where MKL's blocking is as fast.
MIN_ROWS, MAX_ROWS = 2, 128
# Short rows (fewer input features than this) over more tokens than that: MKL's own F.linear was faster
# than the float32 kernel (a small model's weights stay in cache, and the kernel's total of each output
# across its vector lanes is a larger share of a short row: 10M Llama's layers at 64 tokens, 1.0-1.15x).
F32_SHORT_ROW, F32_SHORT_ROW_TOKENS = 512, 32
# Rows up to which a bfloat16 step takes the AMX kernel rather than oneDNN's packed weight (measured
# above); larger steps (prefill chunks) are compute-bound, where oneDNN's kernels are as fast or faster.
AMX_MAX_ROWS = 64
# CPU vendors (/proc/cpuinfo's vendor_id) whose VDPBF16PS retires at a float32 FMA's rate, so that
# oneDNN's bfloat16 kernels, built on it, do twice the FMAs' work: AMD's, whose only CPUs with AVX-512
# BF16 are Zen 4 and 5 (an EPYC of Zen 4: one VDPBF16PS or FMA per 0.55 ns; the Xeons measured retired
# VDPBF16PS at a quarter of the FMA's rate). There the AVX-512 BF16 kernel takes steps of up to
# FAST_DOT_KERNEL_MAX_ROWS rows (bound by reading the weight, which it does faster) and oneDNN's packed
# weight the rest (the 100M Llama's projections on that EPYC: the kernel 1.37-1.58x oneDNN's speed at
# 1-2 rows, 0.95x at 3, 0.34-0.38x at 16-128).
FAST_DOT_VENDORS = frozenset({"AuthenticAMD"})
FAST_DOT_KERNEL_MAX_ROWS = 2
PACKER_NICE = 19  # the packing thread's nice value: it runs when no step wants the CPU


class WeightMajorLinear(nn.Linear):
    """An ``nn.Linear`` whose float32 steps of up to MAX_ROWS tokens take keepwarm's AVX-512 kernel
    where ``use_f32_linear`` enabled it, else run weight-major from MIN_ROWS tokens."""

    _kernel = False  # this layer's shape takes the float32 kernel, and the kernel runs here (use_f32_linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if rows > MAX_ROWS or x.dtype != torch.float32 or weight.dtype != torch.float32:
            return F.linear(x, weight, self.bias)
        if self._kernel and weight.is_contiguous() and x.is_cpu and not _grad(x, self):
            if x.shape[-1] < F32_SHORT_ROW and rows > F32_SHORT_ROW_TOKENS:
                return F.linear(x, weight, self.bias)
            if rows:
                return native.f32_linear(x, weight, self.bias)
        if rows < MIN_ROWS:
            return F.linear(x, weight, self.bias)
        out = weight_major(x.reshape(rows, x.shape[-1]), weight)
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features)


def weight_major(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for x [M, in] taken weight-major, ``(weight @ x.T).T``, copied into rows."""
    return torch.mm(weight, x.t()).t().contiguous()


def _grad(x: torch.Tensor, layer: nn.Module) -> bool:
    """Autograd would record this call (the kernels have no backward: torch's ops must run)."""
    return torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in layer.parameters()))


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` whose bfloat16 steps of up to AMX_MAX_ROWS rows run on the AMX kernel where
    ``use_amx_linear`` enabled it, those of up to ``_bf16_max_rows`` (all of them where None) on the
    AVX-512 BF16 kernel where ``use_bf16_linear`` did (CPUs without AMX), and otherwise those of two
    rows or more on oneDNN's packed weight once ``pack`` has made it; otherwise, and for other dtypes,
    exactly ``nn.Linear``."""

    # (the weight's data pointer it was packed from, the packed weight); None until packed
    _packed: tuple[int, torch.Tensor] | None = None
    _amx = False  # this layer's shape takes the AMX kernel, and the kernel runs here (use_amx_linear)
    _bf16 = False  # ... the AVX-512 BF16 kernel, and it runs here (use_bf16_linear)
    _bf16_max_rows: int | None = None  # the most rows of a step it takes (None: every step)

    def _kernel_step(self, x: torch.Tensor, max_rows: int | None) -> bool:
        """``x`` is a step a kernel that reads this layer's weight in place can take: of at least one
        row and at most ``max_rows`` (None: any number), in the weight's dtype, on the CPU, the weight
        contiguous."""
        weight = self.weight
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        return (
            x.dtype == weight.dtype
            and rows > 0
            and (max_rows is None or rows <= max_rows)
            and weight.is_contiguous()
            and x.is_cpu
        )

    def amx_takes(self, x: torch.Tensor) -> bool:
        """This step's ``x`` goes to the AMX kernel."""
        return self._amx and self._kernel_step(x, AMX_MAX_ROWS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed, weight = self._packed, self.weight
        if self.amx_takes(x):
            return native.amx_linear(x, weight, self.bias)
        if self._bf16 and self._kernel_step(x, self._bf16_max_rows):
            return native.bf16_linear(x, weight, self.bias)
        if packed is None or x.dtype != weight.dtype or x.numel() == x.shape[-1]:
            return F.linear(x, weight, self.bias)
        if packed[0] != weight.data_ptr():  # the weight was replaced (sleep, wake): pack it again
            self._packed = None
            return F.linear(x, weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed[1], self.bias, "none", [], "")

    def pack(self) -> bool:
        """Make the packed weight (a no-op when it is current); False when the weight has no data."""
        weight = self.weight
        if weight.device.type != "cpu" or weight.is_meta:
            return False
        if self._packed is None or self._packed[0] != weight.data_ptr():
            self._packed = (weight.data_ptr(), torch.ops.mkldnn._reorder_linear_weight(weight.detach()))
        return True


# The layer classes that compute exactly nn.Linear's product (LoRA adapts these, and no subclass else).
PLAIN_LINEARS = (nn.Linear, WeightMajorLinear, PackedLinear)


def amx_takes(out_features: int, in_features: int) -> bool:
    """The AMX kernel's shapes: whole tiles of 32 input features and 16 outputs, neither empty."""
    return in_features > 0 and in_features % 32 == 0 and out_features > 0 and out_features % 16 == 0


def gate_up_silu(gate: nn.Module, up: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate(x)) * up(x)`` in one AMX pass (the same bits as the two layers and SiLU-and-mul),
    where both layers would send ``x`` to the kernel, have no bias and nothing watches them one at a
    time (a LoRA slot's or a tensor-parallel shard's hooks); None where the caller must run them."""
    if type(gate) is not PackedLinear or type(up) is not PackedLinear:
        return None
    if not (gate.amx_takes(x) and up.amx_takes(x)):
        return None
    if gate.bias is not None or up.bias is not None or gate.weight.shape != up.weight.shape:
        return None
    if _hooked(gate) or _hooked(up) or (torch.is_grad_enabled() and x.requires_grad):
        return None
    return native.amx_gate_up_silu(x, gate.weight, up.weight)


def _hooked(module: nn.Module) -> bool:
    """Forward hooks would see this layer's call: its own or torch's global ones."""
    from torch.nn.modules import module as torch_module

    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or torch_module._global_forward_hooks
        or torch_module._global_forward_pre_hooks
    )


def _library_unavailable(
    kernel_cache: str | None, has_kernel: Callable[[], bool], missing: str
) -> str | None:
    """Why a kernel of keepwarm's CPU library cannot run in this process (the library does not load:
    ``kernel_cache``, the node's builds, tried first; or ``has_kernel()`` says no: ``missing``)."""
    try:
        native.load(kernel_cache)
    except native.KernelUnavailable as exc:
        return f"keepwarm's CPU library did not load ({exc})"
    return None if has_kernel() else missing


def _send_to_kernel(
    layers: list, why_not: Callable[[], str | None], stays: str, takes: Callable[[nn.Linear], bool], flag: str
) -> int:
    """Set ``flag`` on each of ``layers`` whose shape the kernel ``takes``; returns how many (0, with
    ``why_not()`` in the log after ``stays``, where the kernel cannot run)."""
    if not layers:
        return 0
    if (why := why_not()) is not None:
        log.info("%s: %s", stays, why)
        return 0
    for layer in layers:
        setattr(layer, flag, takes(layer))
    return sum(getattr(layer, flag) for layer in layers)


def amx_unavailable(kernel_cache: str | None = None) -> str | None:
    """Why the AMX kernel cannot run in this process, or None where it can."""
    missing = "no AMX tiles in this CPU, kernel build or process"
    return _library_unavailable(kernel_cache, native.amx_linear_available, missing)


def use_amx_linear(layers: list[PackedLinear], kernel_cache: str | None = None) -> int:
    """Send the decode-size steps of those layers whose shape the AMX kernel takes (K % 32, N % 16) to
    it, where keepwarm's CPU library loads (``kernel_cache``: the node's builds, tried first) and has
    it; returns how many layers take it (0, with the reason in the log, where it cannot run)."""
    return _send_to_kernel(
        layers,
        lambda: amx_unavailable(kernel_cache),
        "bfloat16 linear layers take no AMX kernel",
        lambda layer: amx_takes(layer.out_features, layer.in_features),
        "_amx",
    )


def bf16_unavailable(kernel_cache: str | None = None) -> str | None:
    """Why the AVX-512 BF16 kernel cannot run in this process, or None where it can."""
    missing = "no AVX-512 BF16 in this CPU or kernel build"
    return _library_unavailable(kernel_cache, native.bf16_linear_available, missing)


def bf16_kernel_max_rows(vendor: str) -> int | None:
    """The most rows of a step the AVX-512 BF16 kernel takes on a CPU of ``vendor`` (None: every step)."""
    return FAST_DOT_KERNEL_MAX_ROWS if vendor in FAST_DOT_VENDORS else None


def use_bf16_linear(
    layers: list[PackedLinear], kernel_cache: str | None = None, vendor: str | None = None
) -> int:
    """Send the steps of those layers whose shape the AVX-512 BF16 kernel takes (N % 4) to it (every
    step, or those of up to FAST_DOT_KERNEL_MAX_ROWS rows on a CPU of FAST_DOT_VENDORS: ``vendor``,
    this CPU's by default), where keepwarm's CPU library loads and has it and the CPU has no AMX tiles
    (there bfloat16 stays with the AMX kernel and oneDNN's AMX kernels: this one was measured without
    AMX only); returns how many layers take it (0, with the reason in the log, where it does not run)."""

    def why_not() -> str | None:
        if (why := bf16_unavailable(kernel_cache)) is not None:
            return why
        return (
            "AMX tiles here: the AMX kernel and oneDNN take them" if native.amx_linear_available() else None
        )

    taken = _send_to_kernel(
        layers,
        why_not,
        "bfloat16 linear layers stay off the AVX-512 BF16 kernel",
        lambda layer: avx512_kernel_takes(layer.out_features),
        "_bf16",
    )
    max_rows = bf16_kernel_max_rows(cpu_vendor() if vendor is None else vendor)
    for layer in layers:
        layer._bf16_max_rows = max_rows
    if taken and max_rows is not None:
        log.info(
            "bfloat16 steps of up to %d rows take the AVX-512 BF16 kernel, larger ones oneDNN's packed "
            "weights: this CPU's dot products run at its FMAs' rate",
            max_rows,
        )
    return taken


def needs_packed_copy(layer: PackedLinear) -> bool:
    """Some of the layer's steps go to oneDNN's packed weight: it takes no kernel, or one that leaves
    it the larger steps (AMX's, and the AVX-512 BF16 kernel's on a CPU of FAST_DOT_VENDORS)."""
    return not layer._bf16 or layer._bf16_max_rows is not None


def packed_weights_supported() -> bool:
    """oneDNN runs bfloat16 natively here (AVX-512 BF16 or AMX); elsewhere packing gains nothing."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def use_packed_linear(model: nn.Module) -> list[PackedLinear]:
    """Turn the model's plain bfloat16 ``nn.Linear`` layers into PackedLinear (not packed yet)."""
    layers = []
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.dtype == torch.bfloat16:
            module.__class__ = PackedLinear
            layers.append(module)
    return layers


class LinearPacker:
    """Packs a model's PackedLinear layers in a background thread (oneDNN's reorder releases the GIL),
    so a start or a wake does not wait for it; steps use each layer's packed weight once it is there."""

    def __init__(self, layers: list[PackedLinear]):
        self.layers = layers
        self.thread: threading.Thread | None = None
        self.niceness: int | None = None  # the packing thread's nice value, once it runs

    def start(self) -> None:
        if self.layers:
            self.thread = threading.Thread(target=self._run, name="keepwarm-pack-linears", daemon=True)
            self.thread.start()

    def drop(self) -> None:
        """Let go of every packed copy (sleep frees the weights' memory), after a running pack ends."""
        if self.thread is not None:
            self.thread.join()
        for layer in self.layers:
            layer._packed = None

    def _run(self) -> None:
        self.niceness = _lower_this_threads_priority()
        start, packed = time.monotonic(), 0
        try:
            for layer in self.layers:
                packed += layer.pack()
        except Exception:  # a failure costs speed, never a request: the layer stays unpacked
            log.exception("packing bfloat16 linear weights stopped after %d layers", packed)
            return
        log.info("packed %d bfloat16 linear weights in %.2fs", packed, time.monotonic() - start)


def _lower_this_threads_priority() -> int | None:
    """Give the calling thread (and the OpenMP threads it starts, which inherit it) the lowest CPU
    priority: packing must not slow the steps it is meant to speed up. On 2 cores with 2 intra-op
    threads, a 1 GiB bfloat16 model's first request after ready took 0.53-1.13 s beside a packer at the
    steps' priority against 0.24-0.26 s with no packing. Linux's nice is per thread; raising it needs
    no privilege. The nice value it runs at, None where it cannot be set."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, PACKER_NICE)
        return os.getpriority(os.PRIO_PROCESS, tid)
    except (OSError, AttributeError):  # not Linux, or a seccomp profile without setpriority
        return None


def use_weight_major_linear(model: nn.Module) -> list[WeightMajorLinear]:
    """Turn the model's plain float32 ``nn.Linear`` layers into WeightMajorLinear (subclasses such as
    FP8 layers stay as they are); returns those that changed."""
    layers = []
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.dtype == torch.float32:
            module.__class__ = WeightMajorLinear
            layers.append(module)
    return layers


def avx512_kernel_takes(out_features: int) -> bool:
    """The AVX-512 kernels' shapes (float32 and bfloat16): whole groups of 4 output features (they store
    4 at a time)."""
    return out_features > 0 and out_features % 4 == 0


def f32_unavailable(kernel_cache: str | None = None) -> str | None:
    """Why the float32 kernel cannot run in this process, or None where it can."""
    missing = "no AVX-512 in this CPU or kernel build"
    return _library_unavailable(kernel_cache, native.f32_linear_available, missing)


def use_f32_linear(layers: list[WeightMajorLinear], kernel_cache: str | None = None) -> int:
    """Send the steps of up to MAX_ROWS tokens of those layers whose shape the float32 kernel takes to
    it, where keepwarm's CPU library loads (``kernel_cache`` tried first) and has it; returns how many
    layers take it (0, with the reason in the log, where it cannot run)."""
    return _send_to_kernel(
        layers,
        lambda: f32_unavailable(kernel_cache),
        "float32 linear layers stay on MKL",
        lambda layer: avx512_kernel_takes(layer.out_features),
        "_kernel",
    )
