"""FlashInfer attention backend (CUDA): paged prefill/decode wrappers over the same KV layout.

The cache layout [num_blocks, block_size, kv_heads, dim] is FlashInfer's "NHD" paged layout, so the
blocks the scheduler hands out are FlashInfer pages as they are. Each forward pass plans once per
distinct (scale, window, softcap, head dims) and reuses the plan for every layer that shares it; a
batch of single-token queries uses the decode wrapper, anything else the prefill wrapper (which
handles chunked prefill and prefix hits mixed with decodes). Sinks are refused: use the torch
backend for models with attention sinks. Importing this module fails without flashinfer-python
(extra `keepwarm-runtime[gpu]`). Untested on GPU in CI: scripts/gpu-check runs it.
"""

from __future__ import annotations

import flashinfer
import torch

from keepwarm_runtime.engine.attention.layer import KeepwarmAttention
from keepwarm_runtime.engine.attention.metadata import AttentionMetadata
from keepwarm_runtime.engine.attention.window import Window, effective_window

WORKSPACE_BYTES = 256 << 20


class FlashInferAttentionBackend:
    name = "flashinfer"

    def __init__(self, device: torch.device):
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=True
        )

    def check_layer(self, layer: KeepwarmAttention) -> None:
        """Refuse, at load, a layer whose window differs between prompt and generated positions."""
        window = effective_window(layer.probe_window, layer.cache_window)
        if not window.uniform:
            raise NotImplementedError(
                f"{layer.owner} layer_idx {layer.layer_idx}: transformers windows generated tokens "
                f"({window.generated}) but not the prompt ({window.prompt}); the flashinfer backend plans "
                "one window per pass: use attention_backend='torch'"
            )

    def forward(
        self,
        layer: KeepwarmAttention,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: Window,
        softcap: float | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        if sinks is not None:
            raise NotImplementedError(
                f"{layer.owner}: attention sinks are not supported by the flashinfer backend; "
                "use attention_backend='torch'"
            )
        if not window.uniform:
            raise NotImplementedError(f"{layer.owner}: window {window} is not uniform; use the torch backend")
        q = query[0].transpose(0, 1).contiguous()  # [T, H, Dk]; the layer has cached this step's K/V
        wrapper = self._plan(meta, q, layer, scale, window.prompt, softcap)
        out = wrapper.run(q, (layer.k_cache, layer.v_cache))  # [T, H, Dv]
        return out.unsqueeze(0)

    def _plan(self, meta, q, layer, scale, window, softcap):
        key = (
            "flashinfer",
            scale,
            window,
            softcap,
            q.shape[1],
            layer.k_cache.shape[2:],
            layer.v_cache.shape[-1],
        )
        if meta.memo.get("flashinfer-current") == key:
            return meta.memo["flashinfer-wrapper"]
        indptr, indices, last = _page_table(meta)
        heads, kv_heads, dk = q.shape[1], layer.k_cache.shape[2], q.shape[-1]
        dv = layer.v_cache.shape[-1]
        common = {
            "sm_scale": scale,
            "window_left": (window - 1) if window else -1,
            "logits_soft_cap": softcap or 0.0,
            "q_data_type": q.dtype,
            "kv_data_type": layer.k_cache.dtype,
        }
        if meta.max_query_len == 1 and dk == dv:
            self.decode.plan(indptr, indices, last, heads, kv_heads, dk, meta.block_size, **common)
            wrapper = self.decode
        else:
            self.prefill.plan(
                meta.query_start.cpu(),
                indptr,
                indices,
                last,
                heads,
                kv_heads,
                dk,
                meta.block_size,
                causal=True,
                head_dim_vo=dv,
                **common,
            )
            wrapper = self.prefill
        meta.memo["flashinfer-current"] = key
        meta.memo["flashinfer-wrapper"] = wrapper
        return wrapper


def _page_table(meta: AttentionMetadata):
    memo = meta.memo.get("flashinfer-pages")
    if memo is None:
        bs = meta.block_size
        ctx = torch.tensor(meta.context_lens_list, dtype=torch.int32)
        pages = (ctx + bs - 1) // bs
        indptr = torch.zeros(len(ctx) + 1, dtype=torch.int32)
        indptr[1:] = pages.cumsum(0)
        tables = meta.block_tables.cpu()
        used = torch.arange(tables.shape[1])[None, :] < pages[:, None]
        indices = tables[used].to(torch.int32).to(meta.block_tables.device)
        last = ctx - (pages - 1) * bs
        memo = meta.memo["flashinfer-pages"] = (indptr, indices, last)
    return memo
