"""keepwarm's compiled CPU decode kernel (attention/native.py, csrc/paged_decode.cpp): built for real with
this machine's compiler, checked against SDPA over the gathered cache at contexts of many blocks, in
float32, bfloat16 and float16, with few sequences (work split by KV head) and many (by sequence); a
build that fails and inputs it cannot take are named refusals; selection falls back to torch by name."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from keepwarm_runtime.engine.attention import native
from keepwarm_runtime.engine.attention.cpu_backend import CpuAttentionBackend, first_keys
from keepwarm_runtime.engine.attention.select import BackendUnavailable, select_backend
from keepwarm_runtime.engine.attention.torch_backend import TorchAttentionBackend
from keepwarm_runtime.engine.attention.window import Window

BS = 16


def paged_case(contexts: list[int], dtype: torch.dtype, heads=12, kv_heads=4, dk=64, dv=64, seed=0):
    """Caches with each sequence's blocks scattered, and per sequence the keys/values in order."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-c // BS) for c in contexts]
    order = torch.randperm(sum(blocks) + 3, generator=g).tolist()
    k_cache = torch.randn(sum(blocks) + 3, BS, kv_heads, dk, generator=g).to(dtype)
    v_cache = torch.randn(sum(blocks) + 3, BS, kv_heads, dv, generator=g).to(dtype)
    tables = torch.zeros(len(contexts), max(blocks), dtype=torch.int32)
    for b, n in enumerate(blocks):
        tables[b, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
    query = torch.randn(len(contexts), heads, dk, generator=g).to(dtype)
    return query, k_cache, v_cache, tables


def reference(query, k_cache, v_cache, tables, starts, ends, scale):
    out = []
    for b in range(query.shape[0]):
        ids = tables[b].long()
        k = k_cache[ids].flatten(0, 1)[starts[b] : ends[b]].float().transpose(0, 1)  # [Hkv, L, D]
        v = v_cache[ids].flatten(0, 1)[starts[b] : ends[b]].float().transpose(0, 1)
        q = query[b].float()[:, None]  # [H, 1, D]
        out.append(F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)[:, 0])
    return torch.stack(out)


# (key dim, value dim): the unrolled widths, a width vectorised with a runtime count, MLA's wider keys,
# widths the scalar loops take (and, on AVX-512, the in-place 16-bit loops' partial vectors), and keys
# wider than those loops take (16-bit blocks widened into a buffer first).
DIMS = [(64, 64), (128, 128), (80, 80), (192, 128), (24, 8), (288, 32)]


# (query heads, KV heads): groups of 3 (the accumulators' runs of 2 and 1), 8 (two runs of 4) and 1.
GROUPS = [(12, 4), (16, 2), (4, 4)]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("contexts", [[1500], [3, 700], [17, 1, 640, 33, 129, 1023, 256, 64, 5]])
@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("groups", GROUPS)
def test_kernel_matches_sdpa_over_the_gathered_cache(dtype, contexts, dims, groups) -> None:
    native.load()
    heads, kv_heads = groups
    query, k_cache, v_cache, tables = paged_case(contexts, dtype, heads, kv_heads, dk=dims[0], dv=dims[1])
    ends = torch.tensor(contexts)
    starts = torch.zeros_like(ends)
    starts[0] = contexts[0] // 3  # a window on the first sequence
    out = torch.empty(query.shape[0], query.shape[1], v_cache.shape[-1], dtype=dtype)
    native.paged_decode_attention(out, query, k_cache, v_cache, tables, starts, ends, 0.125, None, None)
    want = reference(query, k_cache, v_cache, tables, starts, ends, 0.125)
    torch.testing.assert_close(out.float(), want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_nan_key_spoils_only_its_heads_and_huge_scores_stay_finite(dtype) -> None:
    """The softmax's max is taken lane by lane: a NaN score never becomes the max, so it spoils the
    heads that read it (NaN, as SDPA gives) and no other; scores far beyond exp's range (keys of 1e4)
    are shifted by the max and weigh as SDPA weighs them."""
    native.load()
    contexts = [40, 37, 16]
    query, k_cache, v_cache, tables = paged_case(contexts, dtype, heads=8, kv_heads=2)
    k_cache[tables[1, 1], 5, 0, 3] = float("nan")  # sequence 1, token 21, KV head 0 (query heads 0-3)
    k_cache[tables[2, 0]] *= 1e4  # sequence 2: scores of about 1e5
    ends = torch.tensor(contexts)
    starts = torch.zeros_like(ends)
    out = torch.empty_like(query)
    native.paged_decode_attention(out, query, k_cache, v_cache, tables, starts, ends, 0.125, None, None)
    want = reference(query, k_cache, v_cache, tables, starts, ends, 0.125)
    assert out[1, :4].isnan().all() and want[1, :4].isnan().all()
    assert out[2].isfinite().all()
    torch.testing.assert_close(out[1, 4:].float(), want[1, 4:], rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    for b in (0, 2):
        torch.testing.assert_close(out[b].float(), want[b], rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_softcap_and_sinks_match_the_eager_formula(dtype) -> None:
    native.load()
    contexts = [70, 300, 5, 129, 1, 64, 16, 900]
    query, k_cache, v_cache, tables = paged_case(contexts, dtype)
    ends = torch.tensor(contexts)
    sinks = torch.randn(query.shape[1])
    out = torch.empty_like(query)
    native.paged_decode_attention(out, query, k_cache, v_cache, tables, ends * 0, ends, 0.2, 3.0, sinks)
    for b, n in enumerate(contexts):
        ids = tables[b].long()
        k = k_cache[ids].flatten(0, 1)[:n].repeat_interleave(3, dim=1).float()  # [n, H, D]: 12 heads over 4
        v = v_cache[ids].flatten(0, 1)[:n].repeat_interleave(3, dim=1).float()
        s = torch.einsum("hd,nhd->hn", query[b].float(), k) * 0.2
        s = torch.tanh(s / 3.0) * 3.0
        p = torch.softmax(torch.cat([s, sinks[:, None]], dim=1), dim=1)[:, :-1]
        want = torch.einsum("hn,nhd->hd", p, v)
        torch.testing.assert_close(out[b].float(), want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


def test_first_keys_bound_the_window_as_the_mask_does() -> None:
    positions, prompt_lens = torch.tensor([0, 5, 9, 9]), torch.tensor([1, 8, 8, 12])
    got = first_keys(positions, prompt_lens, Window(prompt=4, generated=2))
    assert got.tolist() == [0, 2, 8, 6]  # prompt positions see 4 keys, generated ones 2
    assert first_keys(positions, prompt_lens, Window(None, None)).tolist() == [0, 0, 0, 0]


def test_inputs_it_cannot_take_are_refused_by_name() -> None:
    native.load()
    query, k_cache, v_cache, tables = paged_case([20, 40], torch.float32)
    out = torch.empty(2, 12, 64)
    ends = torch.tensor([20, 40])
    with pytest.raises(RuntimeError, match="block_tables: int32"):
        native.paged_decode_attention(
            out, query, k_cache, v_cache, tables.long(), ends * 0, ends, 1.0, None, None
        )
    with pytest.raises(RuntimeError, match="share one dtype"):
        native.paged_decode_attention(
            out, query.double(), k_cache, v_cache, tables, ends * 0, ends, 1.0, None, None
        )
    with pytest.raises(RuntimeError, match="one start/end per sequence"):
        native.paged_decode_attention(out, query, k_cache, v_cache, tables, ends[:1], ends, 1.0, None, None)


def test_a_build_that_fails_is_a_named_error(tmp_path, monkeypatch) -> None:
    broken = tmp_path / "paged_decode.cpp"
    broken.write_text("this is not C++;\n")
    monkeypatch.setattr(native, "SOURCES", (broken, *native.SOURCES[1:]))
    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setattr(native, "_failed", None)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    with pytest.raises(native.KernelUnavailable, match="Error") as first:
        native.load()
    # asked again (the attention backend, the fused kernels, the AMX linears), the same error without
    # another build: the builder is not called
    monkeypatch.setattr("torch.utils.cpp_extension.load", lambda **kwargs: pytest.fail("built again"))
    with pytest.raises(native.KernelUnavailable) as again:
        native.load()
    assert again.value is first.value


@pytest.mark.parametrize("extensions_dir", [None, "ext"])
def test_a_cached_build_is_found_where_torchs_builder_puts_it(tmp_path, monkeypatch, extensions_dir) -> None:
    """The direct load (no builder import) looks in the builder's own folder, with and without
    TORCH_EXTENSIONS_DIR; nothing there means the builder runs."""
    from torch.utils import cpp_extension

    if extensions_dir is None:
        monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    else:
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / extensions_dir))
    name = "keepwarm_cpu_probe"
    assert native._built_library(name) is None
    folder = Path(cpp_extension._get_build_directory(name, verbose=False))  # creates it
    (folder / f"{name}.so").write_bytes(b"")
    assert native._built_library(name) == folder / f"{name}.so"


def test_a_build_is_named_for_the_cpu_it_was_made_for(monkeypatch) -> None:
    here = native.library_name()
    monkeypatch.setattr(native, "_cpu_flags", lambda: "sse2 avx2")
    assert native.library_name() != here


def test_a_build_is_named_for_the_torch_it_links(monkeypatch) -> None:
    here = native.library_name()
    monkeypatch.setattr(torch, "__version__", "0.0.0+other")
    assert native.library_name() != here


def test_the_node_folder_is_an_argument_and_main_resolves_its_variable(tmp_path, monkeypatch) -> None:
    """load() looks in the folder it is given, never in the environment; `python -m ...native` resolves
    KEEPWARM_KERNEL_CACHE (the name the operator sets on CPU pods) at its entry point."""
    from keepwarm_api import podenv
    from keepwarm_api.settings import env_names, resolve

    name = "keepwarm_cpu_probe"
    (tmp_path / name).mkdir()
    (tmp_path / name / f"{name}.so").write_bytes(b"")
    monkeypatch.setenv(podenv.KERNEL_CACHE, str(tmp_path))
    assert native._node_build(name, None) is None
    assert native._node_build(name, tmp_path) == tmp_path / name / f"{name}.so"
    assert env_names(native.BuildSettings) == {podenv.KERNEL_CACHE}
    assert resolve(native.BuildSettings, native.parser().parse_args([])).kernel_cache == str(tmp_path)
    flagged = native.parser().parse_args(["--kernel-cache", "/k"])
    assert resolve(native.BuildSettings, flagged).kernel_cache == "/k"


def test_a_fresh_process_loads_the_node_agents_build_and_builds_nothing(tmp_path) -> None:
    """What a CPU runtime pod does with the folder its node's agent built into (KEEPWARM_KERNEL_CACHE,
    mounted read-only): a real process loads that build and writes no build of its own."""
    import os
    import subprocess
    import sys

    from keepwarm_api.podenv import KERNEL_CACHE

    node, own = tmp_path / "node", tmp_path / "own"
    build = [sys.executable, "-m", "keepwarm_runtime.engine.attention.native"]
    agent = {**os.environ, "TORCH_EXTENSIONS_DIR": str(node)}
    subprocess.run([*build, "--optional"], env=agent, check=True, timeout=600)  # the agent pod's init
    (name,) = [p.name for p in node.iterdir() if p.name.startswith("keepwarm_cpu_")]
    before = sorted((p, p.stat().st_mtime_ns) for p in node.rglob("*"))
    pod = {**os.environ, KERNEL_CACHE: str(node), "TORCH_EXTENSIONS_DIR": str(own)}
    run = subprocess.run(build, env=pod, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == name
    assert f"loaded from {node / name} " in run.stderr
    assert not own.exists()  # the pod's own cache: nothing built, nothing created
    assert sorted((p, p.stat().st_mtime_ns) for p in node.rglob("*")) == before


def test_optional_build_failure_exits_zero_and_says_why(monkeypatch, capsys) -> None:
    def no_compiler(kernel_cache=None):
        raise native.KernelUnavailable("RuntimeError: c++: command not found")

    monkeypatch.setattr(native, "load", no_compiler)
    assert native.main(["--optional"]) == 0
    assert native.main([]) == 1
    assert "cannot be built here: RuntimeError: c++: command not found" in capsys.readouterr().err


def test_auto_on_cpu_falls_back_to_torch_when_the_kernel_cannot_build_and_says_why(caplog) -> None:
    def no_compiler():
        raise native.KernelUnavailable("RuntimeError: c++: command not found")

    with caplog.at_level(logging.WARNING, logger="keepwarm_runtime.engine.attention.select"):
        backend = select_backend("auto", torch.device("cpu"), load_cpu=no_compiler)
    assert type(backend) is TorchAttentionBackend
    assert "c++: command not found" in caplog.text and "torch backend" in caplog.text
    with pytest.raises(BackendUnavailable, match="command not found"):
        select_backend("cpu", torch.device("cpu"), load_cpu=no_compiler)
    with pytest.raises(BackendUnavailable, match="CPU only"):
        select_backend("cpu", torch.device("cuda"))


def test_auto_on_cpu_uses_the_kernel_where_it_builds() -> None:
    assert type(select_backend("auto", torch.device("cpu"))) is CpuAttentionBackend


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_kv_is_index_copy(dtype) -> None:
    """The cpu backend's write of a step's keys into their slots: index_copy_'s result, from the
    layout the layer hands it (a [1, Hkv, T, D] view of [T, Hkv, D] projections) and from one whose
    heads are not adjacent; bad slots and shapes are named refusals."""
    native.load()
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(40, 3, 16, generator=g).to(dtype)
    slots = torch.tensor([7, 0, 39, 12, 5])
    adjacent = torch.randn(1, 5, 3, 16, generator=g).to(dtype).transpose(1, 2)[0].transpose(0, 1)
    apart = torch.randn(3, 5, 16, generator=g).to(dtype).transpose(0, 1)  # heads T*D apart
    for rows in (adjacent, apart, adjacent.contiguous()):
        want, got = cache.clone(), cache.clone()
        want.index_copy_(0, slots, rows)
        CpuAttentionBackend.write_kv(got, slots, rows)
        assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="out of range"):
        native.write_kv(cache, torch.tensor([0, 1, 2, 3, 40]), adjacent)
    with pytest.raises(RuntimeError, match="one per row"):
        native.write_kv(cache, slots[:4], adjacent)
    with pytest.raises(RuntimeError, match="one dtype"):
        native.write_kv(cache, slots, adjacent.double())
