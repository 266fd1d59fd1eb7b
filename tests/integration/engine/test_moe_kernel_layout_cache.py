"""The cache holds the FlashInfer CUTLASS expert layout: converted once by the daemon, attached zero-copy.

CPU twin of the GPU path (the kernel itself runs only in tests/gpu): a real cache daemon (host tier,
in this process's thread) started with `expert_layout="flashinfer_cutlass"` writes each MoE model's
fused `gate_up_proj` (its FP8 scales alike) with the up half first. Its arena equals the CUTLASS
runner's own per-client repack of a model-layout arena, bit for bit; an engine asking for that
layout attaches it with `copied_tensors == 0`, holds the same bytes as its disk path (which converts
into its private arena, from the daemon's plan), and generates what the model layout generates
(the torch reference reads it back). `keepwarm serve`'s background attach (engine/prefetch.py)
asks for the converted arena before the engine is built, and the engine takes it.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
import torch

from keepwarm_runtime import LLM, SamplingParams
from keepwarm_runtime.cache.client import CacheAttachError, attach
from keepwarm_runtime.engine.config import EngineConfig
from keepwarm_runtime.engine.llm_engine import LLMEngine
from keepwarm_runtime.engine.moe import flashinfer_backend
from keepwarm_runtime.engine.moe.activation import GatedActivation
from keepwarm_runtime.engine.moe.reference import ExpertWeights
from keepwarm_runtime.weights.kernel_layout import ExpertLayoutError
from tests.integration.engine.shapes import WHOLE_BLOCKS
from tests.integration.engine.strict import bits, differing_bytes, load_strict, prefetched_engine, served

CUTLASS = "flashinfer_cutlass"


class _Daemon:
    def __init__(self, socket_dir: Path, dtype: str, expert_layout: str) -> None:
        from keepwarm_runtime.cache.daemon import CacheDaemon, DaemonConfig

        self.socket_dir = socket_dir
        config = DaemonConfig(socket_dir=socket_dir, tier="host", dtype=dtype, expert_layout=expert_layout)
        self.daemon = CacheDaemon(config)

    def __enter__(self):
        self.daemon.bind()
        self.thread = threading.Thread(target=self.daemon.serve_forever, daemon=True)
        self.thread.start()
        return self

    def add(self, model_dir: Path, quantization: str | None = None):
        return self.daemon.registry.get(self.daemon.add_model(model_dir, quantization=quantization))

    def __exit__(self, *exc) -> None:
        self.daemon.stop()
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    from keepwarm_runtime.modelgen import make_model
    from keepwarm_runtime.modelgen.fp8 import quantize_checkpoint

    root = tmp_path_factory.mktemp("kernel-layout")
    made = {
        arch: make_model(
            root / arch, arch=arch, params="2M", dtype="bfloat16", vocab_size=2048, **WHOLE_BLOCKS
        )
        for arch in ("qwen3_moe", "gpt_oss")
    }
    made["qwen3_moe-fp8"] = root / "qwen3_moe-fp8"
    shutil.copytree(made["qwen3_moe"], made["qwen3_moe-fp8"])
    quantize_checkpoint(made["qwen3_moe-fp8"])
    return made


def _arena(resident) -> dict[str, torch.Tensor]:
    """Name -> tensor of a resident model's arena (a read-only view)."""
    from keepwarm_runtime.cache.backends.host import map_readonly, readonly_tensor

    buf = map_readonly(resident.arena.fd, resident.nbytes)
    return {e.name: readonly_tensor(buf, e.offset, e.dtype, e.shape) for e in resident.layout.entries}


def _load(model_dir: Path, socket_dir: Path | None, layout: str, quantization: str | None = None):
    return load_strict(
        model_dir, socket_dir, dtype="bfloat16", quantization=quantization, expert_layout=layout
    )


# (model, daemon quantization): a float checkpoint, an FP8 checkpoint (per-half scale grids), and a
# float checkpoint the daemon quantizes online (swapped before quantizing, as the disk path does).
CASES = [("qwen3_moe", None), ("qwen3_moe-fp8", None), ("qwen3_moe", "fp8")]
IDS = ["bf16", "fp8-checkpoint", "fp8-online"]


@pytest.mark.parametrize(("model", "quantization"), CASES, ids=IDS)
def test_the_arena_holds_what_the_cutlass_runner_would_have_copied(models, tmp_path, model, quantization):
    with (
        _Daemon(tmp_path / "model", "bfloat16", "model") as plain,
        _Daemon(tmp_path / "cut", "bfloat16", CUTLASS) as cut,
    ):
        before, after = _arena(plain.add(models[model], quantization)), cut.add(models[model], quantization)
        converted = _arena(after)
        assert after.key.conversion.endswith("+flashinfer-cutlass-up-first-v1")
        assert after.nbytes == plain.daemon.registry.get(models[model].name).nbytes  # a reorder, no growth
        stacks = [n for n in before if n.endswith("experts.gate_up_proj")]
        assert stacks and set(after.layout.up_first) >= set(stacks)
        act = GatedActivation("swiglu")
        for name in stacks:
            prefix = name[: -len("gate_up_proj")]
            scale = before.get(name + "_scale_inv")
            weights = ExpertWeights(
                before[name],
                before[prefix + "down_proj"],
                gate_up_scale_inv=scale,
                down_scale_inv=before.get(prefix + "down_proj_scale_inv"),
            )
            fc1, fc2 = flashinfer_backend.cutlass_layout(weights, act)  # the per-client repack it replaces
            assert torch.equal(bits(converted[name]), bits(fc1)), name
            assert torch.equal(bits(converted[prefix + "down_proj"]), bits(fc2)), name
            if scale is not None:
                assert torch.equal(
                    converted[name + "_scale_inv"], flashinfer_backend.cutlass_fp8_scales(weights)[0]
                )
        moved = {
            *after.layout.up_first,
            *(after.layout.quantized[n].scale for n in after.layout.up_first if n in after.layout.quantized),
        }
        for name in set(before) - moved:  # nothing else moves
            assert torch.equal(bits(before[name]), bits(converted[name])), name
        del before, converted


@pytest.mark.parametrize(("model", "quantization"), CASES, ids=IDS)
def test_an_engine_asking_for_the_layout_attaches_it_with_no_copy(models, tmp_path, model, quantization):
    with _Daemon(tmp_path / "sock", "bfloat16", CUTLASS) as cache:
        cache.add(models[model], quantization)
        cached, info = _load(models[model], cache.socket_dir, CUTLASS, quantization)
    disk, disk_info = _load(models[model], None, CUTLASS, quantization)
    assert (info.source, info.reason, info.copied_tensors) == ("cache", None, 0)
    assert disk_info.copied_tensors == 0  # the disk path merged and converted in its arena, as the daemon
    assert differing_bytes(cached, disk) == []
    assert all(choice.backend == "torch" and choice.copied == 0 for choice in info.moe)


def test_a_client_asking_for_another_layout_misses_by_name(models, tmp_path) -> None:
    with _Daemon(tmp_path / "sock", "bfloat16", CUTLASS) as cache:
        cache.add(models["qwen3_moe"])
        with pytest.raises(CacheAttachError, match="differs in: conversion") as miss:
            attach(models["qwen3_moe"], cache.socket_dir, dtype="bfloat16", fallback=False)
        assert miss.value.reason == "mismatch: conversion"
        hit = attach(
            models["qwen3_moe"], cache.socket_dir, dtype="bfloat16", fallback=False, expert_layout=CUTLASS
        )
        assert hit.source == "cache"
        with pytest.raises(ExpertLayoutError, match="expert layout 'shuffled' is unknown"):
            attach(models["qwen3_moe"], cache.socket_dir, expert_layout="shuffled")


def test_an_unknown_daemon_layout_is_refused_by_name(tmp_path) -> None:
    from keepwarm_runtime.cache.daemon import CacheDaemon, DaemonConfig

    with pytest.raises(ExpertLayoutError, match="expert layout 'shuffled' is unknown"):
        CacheDaemon(DaemonConfig(socket_dir=tmp_path, tier="host", expert_layout="shuffled"))


@pytest.mark.parametrize("model", ["qwen3_moe", "qwen3_moe-fp8"])
def test_the_converted_model_generates_what_the_model_layout_does(models, tmp_path, model) -> None:
    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=6, logprobs=5)
    prompt = {"prompt_token_ids": list(range(10, 47))}
    outs = []
    with _Daemon(tmp_path / "sock", "float32", CUTLASS) as cache:
        cache.add(models[model])
        for layout, socket_dir in ((CUTLASS, cache.socket_dir), ("model", None)):
            llm = LLM(
                models[model],
                dtype="float32",
                block_size=4,
                num_kv_blocks=64,
                expert_layout=layout,
                cache_socket_dir=str(socket_dir) if socket_dir else None,
                cache_fallback=False,
            )
            if layout == CUTLASS:
                assert (llm.engine.load_info.source, llm.engine.load_info.copied_tensors) == ("cache", 0)
            outs.append(llm.generate(prompt, params)[0].outputs[0])
            del llm
    assert outs[0].token_ids == outs[1].token_ids
    first = [(t, lp.logprob) for t, lp in outs[0].logprobs[0].items()]
    second = {t: lp.logprob for t, lp in outs[1].logprobs[0].items()}
    assert all(abs(lp - second[t]) < 1e-5 for t, lp in first)


@pytest.mark.parametrize("quantization", [None, "fp8"], ids=["float", "fp8-online"])
def test_the_servers_prefetch_attaches_the_converted_experts(models, tmp_path, quantization) -> None:
    """`keepwarm serve --expert-layout flashinfer_cutlass` attaches before the engine is built (the
    layout resolved on a meta model of config.json, as the daemon's plan resolves it): one hit on the
    converted arena, taken by the loader (no second attach), serving what the disk path serves.
    CPU twin: on a GPU the same request goes to the gpu-tier daemon (untested on GPU)."""
    model_dir = models["qwen3_moe"]
    prompt, params = (
        list(range(10, 47)),
        SamplingParams(temperature=0, max_tokens=6, min_tokens=6, logprobs=5),
    )
    with _Daemon(tmp_path / "sock", "float32", CUTLASS) as cache:
        resident = cache.add(model_dir, quantization)
        engine = prefetched_engine(_engine_config(model_dir, cache.socket_dir, quantization))
        info = engine.load_info
        assert engine.startup.weights_prefetched
        assert (info.source, info.reason, info.copied_tensors) == ("cache", None, 0)
        assert resident.hits == 1  # the prefetch's; the loader asked nothing
        got = served(engine, prompt, params)
        del engine
    want = served(LLMEngine(_engine_config(model_dir, None, quantization)), prompt, params)
    assert got.token_ids == want.token_ids
    assert [{t: lp.logprob for t, lp in d.items()} for d in got.logprobs] == [
        {t: lp.logprob for t, lp in d.items()} for d in want.logprobs
    ]


def _engine_config(model_dir: Path, socket_dir: Path | None, quantization: str | None) -> EngineConfig:
    return EngineConfig(
        str(model_dir),
        dtype="float32",
        block_size=4,
        num_kv_blocks=64,
        expert_layout=CUTLASS,
        quantization=quantization,
        cache_socket_dir=str(socket_dir) if socket_dir else None,
        cache_fallback=False,
    )


def test_models_the_layout_does_not_touch_are_keyed_in_the_model_layout(models, make_tiny, tmp_path) -> None:
    """gpt-oss (transposed, interleaved experts: the CUTLASS runner repacks those, a counted copy on a
    GPU) and dense models are not converted, so a client in either layout attaches them zero-copy."""
    from keepwarm_runtime.weights.layouts import CONVERSION_ID

    with _Daemon(tmp_path / "sock", "bfloat16", CUTLASS) as cache:
        for model_dir in (models["gpt_oss"], make_tiny("llama")):
            resident = cache.add(model_dir)
            assert resident.layout.up_first == frozenset() and resident.key.conversion == CONVERSION_ID
            assert cache.add(model_dir) is resident  # asked again: a no-op, not a reload
            for layout in (CUTLASS, "model"):
                _, info = _load(model_dir, cache.socket_dir, layout)
                assert (info.source, info.copied_tensors) == ("cache", 0), (
                    model_dir.name,
                    layout,
                    info.reason,
                )
    gpt_oss, _ = _load(models["gpt_oss"], None, CUTLASS)
    experts = gpt_oss.model.layers[0].mlp.experts
    weights = ExpertWeights(experts.gate_up_proj, experts.down_proj, transposed=True)
    assert flashinfer_backend.kernel_copies(weights) == 2  # fc1 reordered, fc2 transposed: on a GPU only
