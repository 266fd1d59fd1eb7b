"""bench/throughput.py's vLLM peer: skipped by name where it cannot run, and its KV space sized from the
workload (the runs themselves: tests/integration/bench/test_bench_smoke.py)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import throughput


def test_the_vllm_peer_says_why_it_is_skipped(tmp_path: Path) -> None:
    python = tmp_path / "env" / "bin" / "python"
    assert "--device is cuda:0" in throughput.vllm_skip_reason("cuda:0", python, {"avx2"})
    assert "needs AVX2 or AVX-512" in throughput.vllm_skip_reason("cpu", python, {"sse4_2"})
    missing = throughput.vllm_skip_reason("cpu", python, {"avx2", "fma"})
    assert str(tmp_path / "env") in missing and "make vllm-cpu" in missing
    python.parent.mkdir(parents=True)
    python.touch()
    assert throughput.vllm_skip_reason("cpu", python, {"avx2"}) is None
    assert throughput.vllm_skip_reason("cpu", python, {"avx512f"}) is None


def test_the_vllm_peer_is_a_named_peer_with_its_own_environment() -> None:
    args = throughput.parse_args(["--peers", "vllm"])
    assert args.peers == ["vllm"] and args.vllm_env == throughput.VLLM_ENV and not args.vllm_eager
    assert "vllm" in throughput.parse_args([]).peers  # compared by default where it can run


def test_kv_space_covers_every_request_at_once(tmp_path: Path) -> None:
    config = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    requests = [([1] * 10, 6), ([2] * 20, 4)]
    per_token = 2 * 2 * 2 * 16 * 4  # K and V, layers, KV heads, head dim, float32 bytes
    assert throughput._kv_bytes(str(tmp_path), "float32", requests) == per_token * (16 + 24 + 2 * 16)
    assert throughput._kv_bytes(str(tmp_path), "bfloat16", requests) == per_token // 2 * (16 + 24 + 32)
