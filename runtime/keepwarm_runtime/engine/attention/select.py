"""Pick the attention backend: FlashInfer on CUDA when it imports and its kernels load; on CPU the cpu
backend when keepwarm's kernel builds and loads (attention/native.py); else the torch reference.

FlashInfer compiles or downloads a kernel the first time it is planned unless a prebuilt one ships
(flashinfer-cubin, flashinfer-jit-cache); an image without nvcc would then fail at its first request.
So `auto` warms FlashInfer up here, once, with a one-page decode and prefill, and falls back to the
torch backend with a logged reason on any failure, not only on ImportError. An explicit
`attention_backend='flashinfer'` raises BackendUnavailable with that reason instead. The warm-up uses
one common shape (bfloat16, head dim 128); another dtype or head dim still loads its kernel at first use.
On CPU, `auto` builds (once per machine, then cached) and loads keepwarm's decode kernel the same way:
without a compiler it falls back to torch with the reason logged; an explicit 'cpu' raises instead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

WARMUP_HEADS, WARMUP_HEAD_DIM, WARMUP_PAGE = 8, 128, 16


class BackendUnavailable(RuntimeError):
    """The requested attention backend cannot run here; the message says what to install or change."""


def select_backend(
    name: str,
    device: torch.device,
    load_flashinfer: Callable[[torch.device], Any] | None = None,
    load_cpu: Callable[[], Any] | None = None,
    kernel_cache: str | None = None,
):
    """The backend for `name` ('auto', 'torch', 'cpu' or 'flashinfer'); `load_flashinfer` and
    `load_cpu` build and load those backends (seams for tests; default to the real ones).
    `kernel_cache`: the node's folder of CPU kernel builds, tried first (EngineConfig.kernel_cache)."""
    from keepwarm_runtime.engine.attention.torch_backend import TorchAttentionBackend

    if name == "torch":
        return TorchAttentionBackend()
    if name == "cpu" and device.type != "cpu":
        raise BackendUnavailable("attention_backend='cpu' runs on CPU only; use 'auto' or 'torch'")
    if name in ("cpu", "auto") and device.type == "cpu":
        try:
            return load_cpu() if load_cpu is not None else load_cpu_backend(kernel_cache)
        except Exception as exc:
            reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:400]
            if name == "cpu":
                raise BackendUnavailable(f"the CPU attention kernel cannot run here: {reason}") from exc
            log.warning("attention: using the torch backend, the CPU kernel cannot run here: %s", reason)
            return TorchAttentionBackend()
    if name == "flashinfer" and device.type != "cuda":
        raise BackendUnavailable("attention_backend='flashinfer' needs a CUDA device; use 'torch' on CPU")
    if name in ("flashinfer", "auto") and device.type == "cuda":
        try:
            return (load_flashinfer or load_warm_flashinfer)(device)
        except Exception as exc:
            reason = failure_reason(exc)
            if name == "flashinfer":
                raise BackendUnavailable(f"FlashInfer cannot run here: {reason}") from exc
            log.warning("attention: using the torch backend, FlashInfer cannot run here: %s", reason)
            return TorchAttentionBackend()
    return TorchAttentionBackend()


def failure_reason(exc: BaseException, limit: int = 300) -> str:
    """One line a user can act on: what failed, and the extra to install when it is an import."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())[:limit]
    if isinstance(exc, ImportError):
        return f"not installed ({text}); install keepwarm-runtime[gpu]"
    return f"its kernels did not load at warm-up ({text})"


def load_warm_flashinfer(device: torch.device):
    """Import FlashInfer and run each wrapper once, so a kernel that cannot load fails now."""
    from keepwarm_runtime.engine.attention.flashinfer_backend import FlashInferAttentionBackend

    backend = FlashInferAttentionBackend(device)
    heads, dim, page, dtype = WARMUP_HEADS, WARMUP_HEAD_DIM, WARMUP_PAGE, torch.bfloat16
    k_cache = torch.zeros(1, page, heads, dim, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    query = torch.zeros(1, heads, dim, dtype=dtype, device=device)
    indptr = torch.tensor([0, 1], dtype=torch.int32)  # one sequence on one page, holding one token
    indices = torch.tensor([0], dtype=torch.int32, device=device)
    last = torch.tensor([1], dtype=torch.int32)
    common = {"q_data_type": dtype, "kv_data_type": dtype}
    backend.decode.plan(indptr, indices, last, heads, heads, dim, page, **common)
    backend.decode.run(query, (k_cache, v_cache))
    backend.prefill.plan(indptr, indptr, indices, last, heads, heads, dim, page, causal=True, **common)
    backend.prefill.run(query, (k_cache, v_cache))
    torch.cuda.synchronize(device)
    return backend


def load_cpu_backend(kernel_cache: str | None = None):
    """The backend over keepwarm's CPU kernel, which it loads from ``kernel_cache`` or builds (first time
    on this machine) and loads."""
    from keepwarm_runtime.engine.attention.cpu_backend import CpuAttentionBackend

    return CpuAttentionBackend(kernel_cache)
