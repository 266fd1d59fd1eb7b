"""FlashInfer attention backend (CUDA): paged prefill/decode wrappers over the same KV layout.

The cache layout [num_blocks, block_size, kv_heads, dim] is FlashInfer's "NHD" paged layout, so the
blocks the scheduler hands out are FlashInfer pages as they are. `build()` makes the page table
(indptr, indices, last page lengths) once per forward pass on the host, from the scheduler's host
lists, so nothing is copied back from the device. Each pass plans once per distinct (scale, window,
softcap, head dims) and reuses the plan for every layer that shares it; a batch of single-token
queries uses the decode wrapper, anything else the prefill wrapper (which handles chunked prefill
and prefix hits mixed with decodes). Sinks, and a window that differs between prompt and generated
positions, are refused at load (`check_layer`): use the torch backend. Decode steps replayed from
CUDA graphs (engine/decode_graphs.py) run on a CUDA-graph decode wrapper per bucket, whose page-table
buffers stay where the graph reads them, planned before each replay (`graph_metadata`) with the plan
the bucket's first pass made; a pass that needs a second plan (Gemma 2's alternating windows) is no
graph's (`GraphUnsupported`: those steps run eagerly). Importing this module fails
without flashinfer-python (extra `keepwarm-runtime[gpu]`). Untested on GPU in CI: scripts/gpu-check
runs it.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass
from typing import Any

import flashinfer
import torch

from keepwarm_runtime.engine.attention.layer import KeepwarmAttention, write_kv
from keepwarm_runtime.engine.attention.metadata import AttentionMetadata
from keepwarm_runtime.engine.attention.page_table import page_table
from keepwarm_runtime.engine.attention.window import Window, effective_window
from keepwarm_runtime.engine.decode_graphs import GraphUnsupported

WORKSPACE_BYTES = 256 << 20


@dataclass
class FlashInferStepMetadata:
    common: AttentionMetadata
    query_start: torch.Tensor  # [B+1] int32, host: cumulative new-token counts
    indptr: torch.Tensor  # [B+1] int32, host: each sequence's first page in `indices`
    indices: torch.Tensor  # [pages] int32, host: the KV blocks (pages) of every sequence, in order
    last_page_len: torch.Tensor  # [B] int32, host: tokens in each sequence's last page
    planned: tuple | None = None  # the (scale, window, softcap, dims) the wrappers are planned for
    wrapper: Any = None  # the planned wrapper (prefill or decode); a graph step's: its bucket's
    graph: bool = False  # a decode step padded to a graph bucket (graph_metadata)


class FlashInferAttentionBackend:
    name = "flashinfer"
    write_kv = staticmethod(write_kv)  # the step's new keys and values into the cache (attention/layer.py)

    def __init__(self, device: torch.device):
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=True
        )
        self._graph_wrappers: dict[int, Any] = {}  # bucket size -> its CUDA-graph decode wrapper
        self._graph_plan: tuple | None = None  # (key, plan's arguments) of a graph bucket's first pass

    def check_layer(self, layer: KeepwarmAttention) -> None:
        """Refuse, at load, layers with sinks or a window that differs between prompt and generated
        positions (one window per plan)."""
        if layer.probe_sinks:
            raise NotImplementedError(
                f"{layer.owner} layer_idx {layer.layer_idx}: attention sinks are not supported by the "
                "flashinfer backend; use attention_backend='torch'"
            )
        window = effective_window(layer.probe_window, layer.cache_window)
        if not window.uniform:
            raise NotImplementedError(
                f"{layer.owner} layer_idx {layer.layer_idx}: transformers windows generated tokens "
                f"({window.generated}) but not the prompt ({window.prompt}); the flashinfer backend plans "
                "one window per pass: use attention_backend='torch'"
            )

    def build(self, meta: AttentionMetadata) -> FlashInferStepMetadata:
        """The step's page table, from host lists (FlashInfer's plan() wants host tensors)."""
        table = page_table(meta.context_lens_list, meta.block_tables_list, meta.block_size)
        query_start = [0]
        for n in meta.query_lens_list:
            query_start.append(query_start[-1] + n)
        return FlashInferStepMetadata(
            meta, *(torch.tensor(v, dtype=torch.int32) for v in (query_start, *astuple(table)))
        )

    def graph_metadata(self, meta: AttentionMetadata, size: int) -> FlashInferStepMetadata:
        """A decode step padded to a graph bucket, on the bucket's CUDA-graph wrapper, planned here,
        outside the graph, once a first pass has made the plan (``_plan``, before the capture)."""
        step = self.build(meta)
        step.graph, step.wrapper = True, self._graph_wrapper(size, meta.block_tables.shape[1])
        if self._graph_plan is not None:
            key, args, common = self._graph_plan
            step.wrapper.plan(step.indptr, step.indices, step.last_page_len, *args, **common)
            step.planned = key
        return step

    def _graph_wrapper(self, size: int, max_pages_per_seq: int):
        wrapper = self._graph_wrappers.get(size)
        if wrapper is None:
            device = self.workspace.device
            wrapper = self._graph_wrappers[size] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=True,
                paged_kv_indptr_buffer=torch.zeros(size + 1, dtype=torch.int32, device=device),
                paged_kv_indices_buffer=torch.zeros(
                    size * max_pages_per_seq, dtype=torch.int32, device=device
                ),
                paged_kv_last_page_len_buffer=torch.zeros(size, dtype=torch.int32, device=device),
            )
        return wrapper

    def forward(
        self,
        layer: KeepwarmAttention,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        step: FlashInferStepMetadata,
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
        wrapper = self._plan(step, q, layer, scale, window.prompt, softcap)
        out = wrapper.run(q, (layer.k_cache, layer.v_cache))  # [T, H, Dv]
        return out.unsqueeze(0)

    def _plan(self, step: FlashInferStepMetadata, q, layer, scale, window, softcap):
        key = (scale, window, softcap, q.shape[1], tuple(layer.k_cache.shape[2:]), layer.v_cache.shape[-1])
        if step.planned == key:
            return step.wrapper
        meta = step.common
        heads, kv_heads, dk = q.shape[1], layer.k_cache.shape[2], q.shape[-1]
        dv = layer.v_cache.shape[-1]
        common = {
            "sm_scale": scale,
            "window_left": (window - 1) if window else -1,
            "logits_soft_cap": softcap or 0.0,
            "q_data_type": q.dtype,
            "kv_data_type": layer.k_cache.dtype,
        }
        pages = (step.indptr, step.indices, step.last_page_len)
        args = (heads, kv_heads, dk, meta.block_size)
        if step.graph:  # planned once, before the capture: one plan for every layer of the pass
            if step.planned is not None:
                raise GraphUnsupported(f"{layer.owner}: the pass needs more than one attention plan")
            if dk != dv:
                raise GraphUnsupported(f"{layer.owner}: key and value widths differ ({dk}, {dv})")
            self._graph_plan = (key, args, common)
        if step.graph or (meta.max_query_len == 1 and dk == dv):
            wrapper = step.wrapper if step.graph else self.decode
            wrapper.plan(*pages, *args, **common)
        else:
            self.prefill.plan(
                step.query_start,
                *pages,
                heads,
                kv_heads,
                dk,
                meta.block_size,
                causal=True,
                head_dim_vo=dv,
                **common,
            )
            wrapper = self.prefill
        step.planned, step.wrapper = key, wrapper
        return wrapper
