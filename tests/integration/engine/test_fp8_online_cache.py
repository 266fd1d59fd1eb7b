"""`keepwarm cache serve --quantization fp8`: the daemon quantizes a float checkpoint once, at load.

Real daemon processes (host tier): one started with `--quantization fp8`, one without, over the same
bf16 checkpoints. An engine asking `quantization="fp8"` attaches the quantized arena zero-copy
(`copied_tensors == 0`, every weight inside the daemon's read-only mapping) and holds the same bits
as its own disk path, which quantizes into its private arena from the same plan. The key keeps the
two apart: an FP8 client never attaches float weights, nor a float client FP8 ones. The arena holds
about half the bf16 bytes. `keepwarm serve`'s background attach (engine/prefetch.py) asks the same
key before the engine is built, and the engine takes it.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from keepwarm_runtime import LLM, SamplingParams
from keepwarm_runtime.cache.client import CacheAttachError, attach, connect, request
from keepwarm_runtime.cache.launcher import DaemonProcess
from keepwarm_runtime.engine.config import EngineConfig
from keepwarm_runtime.engine.llm_engine import LLMEngine
from keepwarm_runtime.engine.quant.fp8_modules import Fp8Linear
from keepwarm_runtime.weights.fp8 import E4M3
from tests.integration.engine.shapes import WHOLE_BLOCKS
from tests.integration.engine.strict import bits, differing_bytes, load_strict, prefetched_engine, served

ARCHS = ("llama", "qwen3_moe", "deepseek_v3", "gpt_oss")  # deepseek: partial blocks; gpt_oss: transposed


class Caches:
    def __init__(self, root: Path, models: dict[str, Path], fp8_checkpoint: Path) -> None:
        dirs = list(models.values())
        self.models = models
        self.fp8_checkpoint = fp8_checkpoint  # FP8 made from "wide" offline (modelgen.fp8)
        # The FP8 checkpoint asked to be quantized again: refused by name, the daemon serves the rest.
        self.fp8 = DaemonProcess(
            root / "fp8", [*dirs, fp8_checkpoint], "--dtype", "bfloat16", "--quantization", "fp8"
        )
        self.bf16 = DaemonProcess(root / "bf16", [*dirs, fp8_checkpoint], "--dtype", "bfloat16")
        self.fp8.wait_ready()
        self.bf16.wait_ready()

    def stats(self, daemon: DaemonProcess) -> dict:
        with connect(daemon.socket, timeout_s=10.0) as sock:
            reply, _ = request(sock, {"cmd": "stats"})
        return reply

    def close(self) -> None:
        self.fp8.kill()
        self.bf16.kill()


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    from keepwarm_runtime.modelgen import make_model
    from keepwarm_runtime.modelgen.fp8 import quantize_checkpoint

    root = tmp_path_factory.mktemp("fp8-online")
    models = {
        arch: make_model(root / arch, arch=arch, params="400K", dtype="bfloat16", vocab_size=2048)
        for arch in ARCHS
    }
    models["wide"] = make_model(
        root / "wide", arch="qwen3_moe", params="2M", dtype="bfloat16", vocab_size=2048, **WHOLE_BLOCKS
    )
    fp8_checkpoint = root / "wide-fp8"
    shutil.copytree(models["wide"], fp8_checkpoint)
    quantize_checkpoint(fp8_checkpoint)
    made = Caches(root, models, fp8_checkpoint)
    yield made
    made.close()


def _load(model_dir: Path, socket_dir: Path | None, quantization: str | None = "fp8"):
    return load_strict(model_dir, socket_dir, dtype="bfloat16", quantization=quantization)


def _arena_regions() -> list[tuple[int, int]]:
    maps = Path("/proc/self/maps").read_text().splitlines()
    return [
        tuple(int(x, 16) for x in line.split()[0].split("-"))
        for line in maps
        if "keepwarm:" in line and "r--s" in line
    ]


@pytest.mark.parametrize("arch", ARCHS)
def test_online_fp8_from_the_cache_is_zero_copy_and_equals_the_disk_path(caches, arch) -> None:
    model_dir = caches.models[arch]
    cached, info = _load(model_dir, caches.fp8.socket_dir)
    disk, disk_info = _load(model_dir, None)
    assert (info.source, info.reason, info.copied_tensors) == ("cache", None, 0)
    # The disk path quantized into its private arena, from the daemon's plan: the engine copies nothing.
    assert (disk_info.source, disk_info.copied_tensors) == ("disk", 0)
    assert differing_bytes(cached, disk) == []
    linears = [m for m in cached.modules() if isinstance(m, Fp8Linear)]
    assert linears and all(m.weight.dtype == E4M3 for m in linears)
    assert cached.lm_head.weight.dtype == torch.bfloat16  # the head stays unquantized
    regions = _arena_regions()
    for name, tensor in [*cached.named_parameters(), *cached.named_buffers()]:
        if name in dict(cached.named_parameters()) and tensor.numel():
            ptr = tensor.data_ptr()
            assert any(lo <= ptr < hi for lo, hi in regions), f"{name} is not inside the daemon's arena"


def test_online_fp8_from_the_cache_generates_what_the_disk_path_does(caches) -> None:
    """Same bits are not enough: the modules must be prepared alike (fused expert grids, block size)."""
    prompt = {"prompt_token_ids": list(range(20, 45))}
    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=6, logprobs=5)
    outs = []
    for socket_dir in (caches.fp8.socket_dir, None):
        llm = LLM(caches.models["deepseek_v3"], **_fp8_engine(socket_dir))
        outs.append(llm.generate(prompt, params)[0].outputs[0])
    _assert_same_tokens_and_logprobs(outs[0], outs[1])


def test_the_servers_prefetch_attaches_the_key_the_engine_uses(caches) -> None:
    """`keepwarm serve` attaches before the engine is built, online FP8 too (the settings come from
    config.json and the flag, not the built model): one hit on the daemon's quantized arena, which the
    loader takes (no second attach), serving what an engine without a prefetch serves from disk."""
    model_dir = caches.models["deepseek_v3"]
    hits = caches.stats(caches.fp8)["models"][model_dir.name]["hits"]
    engine = prefetched_engine(_engine_config(model_dir, caches.fp8.socket_dir))
    info = engine.load_info
    assert engine.startup.weights_prefetched
    assert (info.source, info.reason, info.copied_tensors) == ("cache", None, 0)
    assert caches.stats(caches.fp8)["models"][model_dir.name]["hits"] == hits + 1  # the prefetch's only
    prompt, params = (
        list(range(20, 45)),
        SamplingParams(temperature=0, max_tokens=6, min_tokens=6, logprobs=5),
    )
    got = served(engine, prompt, params)
    del engine
    want = served(LLMEngine(_engine_config(model_dir, None)), prompt, params)
    _assert_same_tokens_and_logprobs(got, want)


def _fp8_engine(socket_dir: Path | None) -> dict[str, Any]:
    """The engine settings of these comparisons: online FP8, from ``socket_dir``'s daemon or from disk."""
    return {
        "dtype": "bfloat16",
        "block_size": 4,
        "num_kv_blocks": 64,
        "quantization": "fp8",
        "cache_socket_dir": str(socket_dir) if socket_dir else None,
        "cache_fallback": False,
    }


def _engine_config(model_dir: Path, socket_dir: Path | None) -> EngineConfig:
    return EngineConfig(str(model_dir), **_fp8_engine(socket_dir))


def _assert_same_tokens_and_logprobs(got: Any, want: Any) -> None:
    assert got.token_ids == want.token_ids
    assert [{t: lp.logprob for t, lp in d.items()} for d in got.logprobs] == [
        {t: lp.logprob for t, lp in d.items()} for d in want.logprobs
    ]


def test_the_key_keeps_fp8_and_float_arenas_apart(caches) -> None:
    model_dir = caches.models["llama"]
    with pytest.raises(CacheAttachError, match="quantization"):  # FP8 client, float-only daemon
        _load(model_dir, caches.bf16.socket_dir)
    with pytest.raises(CacheAttachError, match="quantization"):  # float client, FP8-only daemon
        _load(model_dir, caches.fp8.socket_dir, quantization=None)
    _, info = _load(model_dir, caches.bf16.socket_dir, quantization=None)
    assert info.source == "cache"


def test_an_fp8_checkpoint_is_not_quantized_again(caches) -> None:
    failed = caches.stats(caches.fp8)["failed"]
    reason = failed[caches.fp8_checkpoint.name]["reason"]
    assert "already fp8-quantized" in reason, reason
    assert "ERROR" in caches.fp8.stderr and caches.fp8.proc.poll() is None


def test_online_fp8_arena_is_about_half_the_bf16_one_and_equals_the_fp8_checkpoint(caches) -> None:
    """Online quantization in the daemon gives the bytes an FP8 checkpoint quantized offline from the
    same weights gives (whole blocks here, so per-expert and fused-stack grids coincide)."""
    model_dir = caches.models["wide"]
    fp8_stats, bf16_stats = caches.stats(caches.fp8), caches.stats(caches.bf16)
    fp8_bytes = fp8_stats["models"][model_dir.name]["bytes"]
    bf16_bytes = bf16_stats["models"][model_dir.name]["bytes"]
    checkpoint_bytes = bf16_stats["models"][caches.fp8_checkpoint.name]["bytes"]
    fp8 = attach(model_dir, caches.fp8.socket_dir, dtype="bfloat16", fallback=False, online=_online())
    bf16 = attach(model_dir, caches.bf16.socket_dir, dtype="bfloat16", fallback=False)
    quantized = [n for n in fp8.tensors if n + "_scale_inv" in fp8.tensors]
    q_bytes = sum(_nbytes(fp8.tensors[n]) + _nbytes(fp8.tensors[n + "_scale_inv"]) for n in quantized)
    float_bytes = sum(_nbytes(bf16.tensors[n]) for n in quantized)
    print(
        f"\narena bytes (qwen3_moe, hidden 128, 4 experts x 128, vocab 2048): fp8 online {fp8_bytes}, "
        f"fp8 checkpoint {checkpoint_bytes}, bf16 {bf16_bytes}, ratio {fp8_bytes / bf16_bytes:.3f}; "
        f"quantized weights {q_bytes} vs {float_bytes} ({q_bytes / float_bytes:.4f})"
    )
    assert 0.5 <= q_bytes / float_bytes < 0.51  # e4m3 + one float32 per 128x128 block
    assert fp8_bytes / bf16_bytes < 0.75  # embeddings, head and norms stay bf16
    checkpoint = attach(caches.fp8_checkpoint, caches.bf16.socket_dir, dtype="bfloat16", fallback=False)
    assert checkpoint_bytes == fp8_bytes and checkpoint.tensors.keys() == fp8.tensors.keys()
    for name, tensor in fp8.tensors.items():
        assert tensor.dtype == checkpoint.tensors[name].dtype, name
        assert bits(tensor).equal(bits(checkpoint.tensors[name])), name


def _online():
    from keepwarm_runtime.weights.quantization import fp8_settings

    return fp8_settings(None, "fp8")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
