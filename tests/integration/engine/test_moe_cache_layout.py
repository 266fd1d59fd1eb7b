"""The weight cache holds the serving layout: MoE and FP8 models attach zero-copy, with no per-process copy.

A real cache daemon (host tier, in this process's thread) loads each checkpoint; the engine's loader
attaches it and must find every tensor it serves already in the arena (`copied_tensors == 0`), with
the same bytes the disk path produces (it fills a private arena from the same plan, so the engine
copies nothing on either path).
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
import torch

from tests.engine_architectures import ENGINE_ARCHS
from tests.integration.engine.shapes import WHOLE_BLOCKS
from tests.integration.engine.strict import differing_bytes, load_strict


class _Daemon:
    def __init__(self, socket_dir: Path, dtype: str) -> None:
        from keepwarm_runtime.cache.daemon import CacheDaemon, DaemonConfig

        self.socket_dir = socket_dir
        self.daemon = CacheDaemon(DaemonConfig(socket_dir=socket_dir, tier="host", dtype=dtype))

    def __enter__(self):
        self.daemon.bind()
        self.thread = threading.Thread(target=self.daemon.serve_forever, daemon=True)
        self.thread.start()
        return self

    def add(self, model_dir: Path):
        name = self.daemon.add_model(model_dir)
        return self.daemon.registry.get(name)

    def __exit__(self, *exc) -> None:
        self.daemon.stop()
        self.thread.join(timeout=10)


def _load(model_dir: Path, dtype: str, socket_dir: Path | None, quantization: str | None = None):
    return load_strict(model_dir, socket_dir, dtype=dtype, quantization=quantization)


@pytest.mark.parametrize("arch", sorted({*ENGINE_ARCHS, "gpt_oss"}))
def test_cached_model_attaches_with_no_copies(make_tiny, arch, tmp_path) -> None:
    """Every architecture the engine is tested on (tests/engine_architectures.py), and gpt-oss."""
    model_dir = make_tiny(arch)
    with _Daemon(tmp_path / "sock", "float32") as cache:
        cache.add(model_dir)
        cached, info = _load(model_dir, "float32", cache.socket_dir)
    disk, disk_info = _load(model_dir, "float32", None)
    # Either way the tensors come merged (the disk path fills its arena from the daemon's plan).
    assert (info.source, info.copied_tensors, disk_info.source, disk_info.copied_tensors) == (
        "cache",
        0,
        "disk",
        0,
    )
    assert differing_bytes(cached, disk) == []


@pytest.fixture(scope="module")
def fp8_pair(tmp_path_factory) -> tuple[Path, Path]:
    from keepwarm_runtime.modelgen import make_model
    from keepwarm_runtime.modelgen.fp8 import quantize_checkpoint

    bf16 = make_model(
        tmp_path_factory.mktemp("bf16"),
        arch="qwen3_moe",
        params="2M",
        dtype="bfloat16",
        vocab_size=2048,
        **WHOLE_BLOCKS,
    )
    fp8 = tmp_path_factory.mktemp("fp8")
    shutil.copytree(bf16, fp8, dirs_exist_ok=True)
    return bf16, quantize_checkpoint(fp8)


def test_fp8_checkpoint_through_the_cache_is_zero_copy_and_half_the_bytes(fp8_pair, tmp_path) -> None:
    bf16_dir, fp8_dir = fp8_pair
    with _Daemon(tmp_path / "sock", "bfloat16") as cache:
        bf16_model = cache.add(bf16_dir)
        fp8_model = cache.add(fp8_dir)
        cached, info = _load(fp8_dir, "bfloat16", cache.socket_dir)
    disk, _ = _load(fp8_dir, "bfloat16", None)
    assert info.source == "cache" and info.copied_tensors == 0
    assert differing_bytes(cached, disk) == []
    experts = cached.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert experts.gate_up_proj_scale_inv.dtype == torch.float32  # scales never rounded to bf16
    ratio = fp8_model.nbytes / bf16_model.nbytes
    expert_ratio = sum(e.nbytes for e in fp8_model.layout.entries if ".experts." in e.name) / sum(
        e.nbytes for e in bf16_model.layout.entries if ".experts." in e.name
    )
    print(f"arena bytes fp8/bf16: whole model {ratio:.3f}, experts {expert_ratio:.3f}")
    assert 0.5 <= expert_ratio < 0.51  # e4m3 is half of bf16, plus one float32 per 128x128 block
    assert ratio < 0.75  # embeddings, head and norms stay bf16


def test_fp8_deepseek_with_split_scale_grids_through_the_cache(tmp_path) -> None:
    """Experts narrower than a block: gate and up scales keep a grid each after the cache merges them."""
    from keepwarm_runtime.modelgen import make_model
    from keepwarm_runtime.modelgen.fp8 import quantize_checkpoint

    model_dir = make_model(
        tmp_path / "m", arch="deepseek_v3", params="2M", dtype="bfloat16", vocab_size=2048, hidden_size=128
    )
    quantize_checkpoint(model_dir)
    with _Daemon(tmp_path / "sock", "float32") as cache:
        cache.add(model_dir)
        cached, info = _load(model_dir, "float32", cache.socket_dir)
    disk, disk_info = _load(model_dir, "float32", None)
    assert info.copied_tensors == 0 and disk_info.copied_tensors == 0
    assert cached.model.layers[1].mlp.experts.gate_up_proj_scale_inv.shape[1] == 2
    assert differing_bytes(cached, disk) == []


def _mixtral(path: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "mixtral",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        vocab_size=512,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def test_mixtral_legacy_expert_names_merge_in_the_cache(tmp_path) -> None:
    """transformers saves Mixtral with per-expert w1/w2/w3 names under block_sparse_moe; the arena holds
    them merged (under the checkpoint's prefix, which the loader renames without a copy)."""
    _mixtral(tmp_path / "m")
    with _Daemon(tmp_path / "sock", "float32") as cache:
        resident = cache.add(tmp_path / "m")
        cached, info = _load(tmp_path / "m", "float32", cache.socket_dir)
    disk, disk_info = _load(tmp_path / "m", "float32", None)
    assert any(e.name.endswith("experts.gate_up_proj") for e in resident.layout.entries)
    assert info.copied_tensors == 0 and disk_info.copied_tensors == 0
    assert differing_bytes(cached, disk) == []


def test_mixtral_quantized_online_by_the_cache_finds_its_scales_under_renamed_names(tmp_path) -> None:
    """The arena keeps the checkpoint's `block_sparse_moe.experts.gate_up_proj(_scale_inv)`; the engine
    must find those scales under the model's `mlp.experts` names, or it would read e4m3 as float."""
    _mixtral(tmp_path / "m")
    with _Daemon(tmp_path / "sock", "float32") as cache:
        cache.daemon.add_model(tmp_path / "m", quantization="fp8")
        cached, info = _load(tmp_path / "m", "float32", cache.socket_dir, quantization="fp8")
    disk, disk_info = _load(tmp_path / "m", "float32", None, quantization="fp8")
    assert info.source == "cache" and info.copied_tensors == 0 and disk_info.copied_tensors == 0
    experts = cached.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.float8_e4m3fn and experts.gate_up_proj_scale_inv.ndim == 3
    assert differing_bytes(cached, disk) == []


def test_fp8_gpt_oss_checkpoint_through_the_cache(make_tiny, tmp_path) -> None:
    """gpt-oss' FP8 experts (stored transposed, one block grid over the stored axes) attach zero-copy."""
    from keepwarm_runtime.modelgen.fp8 import quantize_checkpoint

    model_dir = tmp_path / "gpt_oss"
    shutil.copytree(make_tiny("gpt_oss"), model_dir)
    quantize_checkpoint(model_dir)
    with _Daemon(tmp_path / "sock", "float32") as cache:
        cache.add(model_dir)
        cached, info = _load(model_dir, "float32", cache.socket_dir)
    disk, _ = _load(model_dir, "float32", None)
    assert (info.source, info.copied_tensors) == ("cache", 0)
    assert cached.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert differing_bytes(cached, disk) == []
