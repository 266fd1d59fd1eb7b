"""Sleep and wake an idle LLMEngine (vLLM's sleep mode): give back its memory, take it back zero-copy.

Level 1 frees the KV cache (and the prefix cache with it) and lets go of the weights where someone
else keeps them: weights attached from the node cache stay resident in the daemon, so the engine's
parameters become meta tensors and the mapping is dropped; weights read from disk have no other
keeper, so level 1 keeps them where they are (host memory) and wake only reallocates the KV cache.
Level 2 also drops weights read from disk (and the decoded-token memo): wake then attaches again,
from the cache or the disk by the usual rules (``--cache-fallback``), with the reason logged.

Waking re-attaches through the same ``attach()`` request the loader made (engine/prefetch.py's
``attach_request``) and points the parameters at the arena again (``fill_parameters``): no copy.
Only weights the engine uses as attached can be let go: an engine that converted tensors at load
(FP8 preparation, expert layouts, MoE repacks: ``LoadInfo.copied_tensors``) refuses to sleep past
level 1's KV part by name, rather than serving weights it could not restore. Decode graphs
(engine/decode_graphs.py) go with the KV cache, whose memory they read, and wake makes them again
(each bucket captured anew on its first step).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from keepwarm_runtime.engine.block_manager import BlockManager
from keepwarm_runtime.engine.kv_cache import allocate_kv_cache
from keepwarm_runtime.engine.loader import fill_parameters
from keepwarm_runtime.engine.prefetch import attach_request

if TYPE_CHECKING:
    from keepwarm_runtime.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)
LEVELS = (1, 2)


class SleepError(RuntimeError):
    """This engine cannot sleep now or at this level; the message says why."""


@dataclass(frozen=True)
class SleepReport:
    level: int
    weights_released: bool  # the parameters were let go (wake attaches them again)
    seconds: float


def weights_can_be_released(engine: LLMEngine) -> str | None:
    """Why the weights cannot be let go and restored zero-copy, or None when they can."""
    info = engine.load_info
    if info.copied_tensors or info.moe:
        return (
            f"the engine converted {info.copied_tensors} tensors at load (FP8, expert layout or MoE "
            "repacks), which a re-attach would not redo"
        )
    if engine.config.quantization is not None:
        return "online quantization holds weights no re-attach restores"
    return None


def sleep(engine: LLMEngine, level: int) -> SleepReport:
    """Free the KV cache and, per ``level``, the weights; SleepError if busy or impossible."""
    if level not in LEVELS:
        raise SleepError(f"level must be one of {LEVELS}, got {level}")
    engine.settle()  # a step still running reads the cache and the weights
    if engine.has_unfinished_requests():
        raise SleepError("requests are running")
    release = level == 2 or engine.load_info.source == "cache"
    why_not = weights_can_be_released(engine) if release else None
    if why_not is not None:
        raise SleepError(f"cannot let go of the weights: {why_not}")
    started = time.perf_counter()
    for layer in engine.layers:
        layer.k_cache = layer.v_cache = None
    engine.runner.graphs = None  # they replay reads of the KV cache's (and the weights') memory
    # The block manager stays (stats read it; every block is free): wake replaces it, since the
    # prefix cache it indexes is gone with the KV cache.
    if release:
        engine.linear_packer.drop()  # packed copies are private memory (engine/cpu_linear.py)
        _to_meta(engine.model)
    if level == 2:
        engine._token_text.clear()
    return SleepReport(level, release, time.perf_counter() - started)


def wake(engine: LLMEngine, weights_released: bool) -> float:
    """Attach the weights again (if they were let go) and reallocate the KV cache; returns seconds."""
    from keepwarm_runtime.cache.client import attach

    started = time.perf_counter()
    config = engine.config
    if weights_released:
        res = attach(**attach_request(config).arguments())
        fill_parameters(engine.model, res.tensors, res.aliases)
        engine.linear_packer.start()
        log.info(
            "woke: weights from %s in %.2fs%s",
            res.source,
            res.seconds,
            f" ({res.reason})" if res.reason else "",
        )
    allocate_kv_cache(
        engine.layers,
        engine.kv_specs,
        engine.num_kv_blocks,
        config.block_size,
        config.torch_dtype,
        engine.device,
    )
    engine.block_manager = engine.scheduler.block_manager = BlockManager(
        engine.num_kv_blocks, config.block_size, config.enable_prefix_caching
    )
    if engine.graph_capture is not None:  # captured again over the new cache, as steps need them
        engine.use_decode_graphs(engine.graph_capture)
    return time.perf_counter() - started


def _to_meta(model: nn.Module) -> None:
    """Point every parameter and persistent buffer at a meta tensor (ties kept), dropping the memory."""
    replaced: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                if id(param) not in replaced:
                    replaced[id(param)] = nn.Parameter(
                        torch.empty_like(param, device="meta"), requires_grad=False
                    )
                module._parameters[name] = replaced[id(param)]
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and name not in module._non_persistent_buffers_set:
                module._buffers[name] = torch.empty_like(buffer, device="meta")
