"""Pick the attention backend: FlashInfer on CUDA when installed, else the torch reference."""

from __future__ import annotations

import torch


class BackendUnavailable(RuntimeError):
    """The requested attention backend cannot run here; the message says what to install or change."""


def select_backend(name: str, device: torch.device):
    from keepwarm_runtime.engine.attention.torch_backend import TorchAttentionBackend

    if name == "torch":
        return TorchAttentionBackend()
    if name == "flashinfer" and device.type != "cuda":
        raise BackendUnavailable("attention_backend='flashinfer' needs a CUDA device; use 'torch' on CPU")
    if name in ("flashinfer", "auto") and device.type == "cuda":
        try:
            from keepwarm_runtime.engine.attention.flashinfer_backend import FlashInferAttentionBackend
        except ImportError as exc:
            if name == "flashinfer":
                raise BackendUnavailable(
                    f"FlashInfer is not installed ({exc}); install keepwarm-runtime[gpu]"
                ) from exc
            return TorchAttentionBackend()
        return FlashInferAttentionBackend(device)
    return TorchAttentionBackend()
