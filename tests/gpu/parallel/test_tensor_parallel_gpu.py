"""Tensor and expert parallel on CUDA: the NCCL path at world size 1, and groups of GPUs where there are.

A group of one (a rendezvous with tensor_parallel_size 1) runs every collective of the parallel path
(NCCL all-reduces and all-gathers of CUDA activations, the step inputs over gloo) on one GPU: its
greedy tokens must be one process's. With two GPUs or more: 2 ranks (cuda:0, cuda:1) against one,
a MoE model with its experts partitioned, and each rank attaching its shard from its own GPU's
daemon (gpu tier, one daemon per GPU holding rank i mod 2). Those skip, with the reason, on one GPU.
The CPU twins: tests/integration/engine/test_tensor_parallel.py, test_expert_parallel.py and
test_tensor_parallel_cache.py (gloo).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from keepwarm_runtime import LLM, SamplingParams
from tests.sweep.judge import conditions

NEW_TOKENS = 8
two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs 2 GPUs: a tensor-parallel group takes one GPU per rank",
)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from keepwarm_runtime.modelgen import make_model

    made = {}

    def make(arch: str) -> Path:
        if arch not in made:
            out = tmp_path_factory.mktemp(f"tp-gpu-{arch}")
            made[arch] = make_model(
                out, arch=arch, params="6M", dtype="float32", vocab_size=2048, initializer_range=0.15
            )
        return made[arch]

    return make


def _tokens(llm: LLM) -> list[list[int]]:
    prompts = [{"prompt_token_ids": list(p)} for c in conditions()[:2] for p in c.prompts]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _llm(model_dir: Path, **settings) -> LLM:
    return LLM(model_dir, dtype="float32", device="cuda", num_kv_blocks=256, block_size=16, **settings)


def test_a_group_of_one_runs_the_nccl_path_and_gives_one_process_tokens(models) -> None:
    import torch.distributed as dist

    from keepwarm_runtime.engine.parallel import group
    from keepwarm_runtime.engine.parallel.launch import rendezvous

    model_dir = models("llama")
    want = _tokens(_llm(model_dir))
    llm = _llm(model_dir, distributed_init_method=rendezvous())
    try:
        assert llm.engine.parallel and dist.get_world_size() == 1
        assert "nccl" in str(dist.get_backend()).lower()
        assert type(llm.engine.runner).__name__ == "ParallelRunner"
        assert _tokens(llm) == want
    finally:
        group.leave()


@two_gpus
@pytest.mark.parametrize(("arch", "expert"), [("llama", False), ("qwen3_moe", True)])
def test_two_gpus_give_one_gpus_tokens(models, arch: str, expert: bool) -> None:
    model_dir = models(arch)
    want = _tokens(_llm(model_dir))
    llm = _llm(model_dir, tensor_parallel_size=2, enable_expert_parallel=expert)
    try:
        assert _tokens(llm) == want
    finally:
        llm.close()


@two_gpus
def test_each_rank_attaches_its_shard_from_its_own_gpus_daemon(models) -> None:
    from keepwarm_runtime.cache.client import connect, request
    from keepwarm_runtime.cache.launcher import DaemonProcess

    model_dir = models("llama")
    root = Path(tempfile.mkdtemp(prefix="kw-tp-"))  # short: GPU sockets are named by UUID
    daemon = DaemonProcess(
        root / "wc",
        [model_dir],
        "--all-gpus",
        "--dtype",
        "float32",
        "--tensor-parallel-size",
        "2",
        tier="gpu",
    )
    try:
        daemon.wait_ready(timeout_s=300)
        want = _tokens(_llm(model_dir))
        llm = _llm(model_dir, tensor_parallel_size=2, cache_socket_dir=str(root / "wc"), cache_fallback=False)
        try:
            assert llm.engine.load_info.source == "cache"  # rank 1 has no fallback either: it attached
            assert _tokens(llm) == want
        finally:
            llm.close()
        held = {}
        for sock in sorted((root / "wc").glob("gpu-*.sock"))[:2]:
            with connect(sock, timeout_s=10.0) as s:
                reply, _ = request(s, {"cmd": "stats"})
            held[sock.name] = sorted(reply["models"])
        assert sorted(held.values()) == [[f"{model_dir.name}.tp0of2"], [f"{model_dir.name}.tp1of2"]]
    finally:
        daemon.kill()
        shutil.rmtree(root, ignore_errors=True)
