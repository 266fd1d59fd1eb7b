"""Loading through the cache with no way around it, and comparing loaded models bit for bit.

The FP8/MoE cache tests load a model once from the daemon and once from disk and require the same
bits: ``load_strict`` turns a cache miss into an error (no disk fallback), so a test cannot pass by
reading the disk twice; ``differing_bytes`` names the parameters and buffers whose dtype or bits differ.
``prefetched_engine`` starts an engine as `keepwarm serve` does (the weights attached in the
background first) and ``served`` runs one prompt on an engine, to compare what two engines serve.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from keepwarm_runtime.engine.config import EngineConfig
from keepwarm_runtime.engine.llm_engine import LLMEngine
from keepwarm_runtime.engine.loader import load_model
from keepwarm_runtime.engine.outputs import CompletionOutput
from keepwarm_runtime.engine.prefetch import WeightPrefetch
from keepwarm_runtime.engine.sampling_params import SamplingParams
from keepwarm_runtime.model_kind import ModelKind


def load_strict(model_dir: Path, socket_dir: Path | None, **engine: Any):
    """``load_model`` of ``model_dir`` from the daemon at ``socket_dir`` (None: from disk), no fallback."""
    config = EngineConfig(
        str(model_dir),
        cache_socket_dir=str(socket_dir) if socket_dir else None,
        cache_fallback=False,
        **engine,
    )
    return load_model(config)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (so NaN payloads and -0.0 compare as stored)."""
    return t.contiguous().view(-1).view(torch.uint8)


def differing_bytes(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    """State-dict entries of two models with the same names whose dtype or bytes differ."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return [k for k in sa if sa[k].dtype != sb[k].dtype or not torch.equal(bits(sa[k]), bits(sb[k]))]


def prefetched_engine(config: EngineConfig) -> LLMEngine:
    """An engine of ``config`` built as `keepwarm serve` builds it: the weights' attach begun in the
    background (engine/prefetch.py) before the engine exists, then handed to its loader."""
    return LLMEngine(config, prefetch=WeightPrefetch.start(config, ModelKind.TEXT))


def served(engine: LLMEngine, prompt_token_ids: list[int], params: SamplingParams) -> CompletionOutput:
    """What ``engine`` serves for one prompt, run to completion."""
    engine.add_request("served", prompt_token_ids, params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                return output.outputs[0]
    raise AssertionError("the request never finished")
