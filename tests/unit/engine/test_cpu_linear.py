"""engine/cpu_linear.py: the weight-major product equals nn.Linear's, and only plain float32 layers
change; the float32 kernel (csrc/avx512_linear.cpp) is within float32 rounding of the exact product,
gives each row the same bits whatever rows share its call, and takes the steps it is for; a packed
bfloat16 layer computes nn.Linear's result bit for bit, packed or not; the AMX kernel
(csrc/amx_linear.cpp) and the AVX-512 BF16 kernel (csrc/avx512_linear.cpp) are within one bfloat16 ulp
of the exact product, and take only the steps and shapes they are for (the second only on a CPU
without AMX)."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from keepwarm_runtime.engine.attention import native
from keepwarm_runtime.engine.cpu_linear import (
    AMX_MAX_ROWS,
    F32_SHORT_ROW,
    F32_SHORT_ROW_TOKENS,
    FAST_DOT_KERNEL_MAX_ROWS,
    MAX_ROWS,
    PACKER_NICE,
    LinearPacker,
    PackedLinear,
    WeightMajorLinear,
    amx_takes,
    amx_unavailable,
    avx512_kernel_takes,
    bf16_kernel_max_rows,
    bf16_unavailable,
    f32_unavailable,
    gate_up_silu,
    needs_packed_copy,
    packed_weights_supported,
    use_amx_linear,
    use_bf16_linear,
    use_f32_linear,
    use_packed_linear,
    use_weight_major_linear,
)


@contextmanager
def intra_op_threads(threads: int) -> Iterator[None]:
    """torch's intra-op thread count set to ``threads`` for the block, then set back."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


native_bf16 = pytest.mark.skipif(
    not packed_weights_supported(), reason="oneDNN has no native bfloat16 here (needs AVX-512 BF16 or AMX)"
)


_no_amx = amx_unavailable()
amx = pytest.mark.skipif(_no_amx is not None, reason=f"the AMX kernel cannot run here: {_no_amx}")
_no_f32 = f32_unavailable()
f32_kernel = pytest.mark.skipif(_no_f32 is not None, reason=f"the float32 kernel cannot run here: {_no_f32}")
_no_bf16 = bf16_unavailable()
bf16_kernel = pytest.mark.skipif(
    _no_bf16 is not None, reason=f"the AVX-512 BF16 kernel cannot run here: {_no_bf16}"
)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 2), (3,), (1, 7), (2, 5), (1, MAX_ROWS), (1, 1), (1, MAX_ROWS + 1)])
def test_same_product_as_nn_linear(shape: tuple[int, ...], bias: bool) -> None:
    torch.manual_seed(len(shape) + shape[-1])
    plain = nn.Linear(96, 160, bias=bias)
    layer = nn.Linear(96, 160, bias=bias)
    layer.load_state_dict(plain.state_dict())
    use_weight_major_linear(layer)
    x = torch.randn(*shape, 96)
    got, want = layer(x), plain(x)
    assert isinstance(layer, WeightMajorLinear) and got.shape == want.shape == (*shape, 160)
    assert got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    rows = x.numel() // 96
    if rows == 1 or rows > MAX_ROWS:  # outside the range it is F.linear itself
        assert torch.equal(got, F.linear(x, plain.weight, plain.bias))


def test_only_plain_float32_linears_change() -> None:
    class Other(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(4, 4), Other(4, 4), nn.Linear(4, 4).to(torch.bfloat16), nn.ReLU())
    assert use_weight_major_linear(model) == [model[0]]
    assert [type(m).__name__ for m in model] == ["WeightMajorLinear", "Other", "Linear", "ReLU"]
    assert list(model[0].state_dict()) == ["weight", "bias"]


def test_a_bfloat16_input_is_refused_as_nn_linear_refuses_it() -> None:
    layer = nn.Linear(8, 8)
    use_weight_major_linear(layer)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    assert torch.equal(layer(x.float()), layer(x.float()))
    with pytest.raises(RuntimeError):  # F.linear's own refusal of mixed dtypes, not a silent cast
        layer(x)


@f32_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("rows", "k", "n"),
    [(1, 96, 160), (5, 17, 4), (6, 16, 36), (7, 1, 8), (13, 1023, 68), (64, 1025, 96), (128, 2048 + 40, 32)],
)
def test_the_float32_kernel_is_the_product_and_each_row_keeps_its_bits(rows, k, n, threads) -> None:
    """Against the float64 product: within float32 rounding of a sum of k terms. Every row alone gives
    the bits it gets among the others (the sums' order depends on k only): tokens that sample alike in
    a step of 1 or 128 sequences. Odd k (a tail under a mask, chunks of 1024 added in the output),
    token counts past a tile's 6, features past a block's 32, a bias."""
    torch.manual_seed(rows * 1000 + k)
    x, weight, bias = torch.randn(rows, k), torch.randn(n, k) / k**0.5, torch.randn(n)
    with intra_op_threads(threads):
        got = native.f32_linear(x, weight, bias)
        alone = torch.cat([native.f32_linear(x[i : i + 1], weight, bias) for i in range(rows)])
    exact = F.linear(x.double(), weight.double(), bias.double())
    bound = 4 * torch.finfo(torch.float32).eps * (x.double().abs() @ weight.double().abs().t() + bias.abs())
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    assert bool(((got.double() - exact).abs() <= bound + 1e-30).all())
    assert torch.equal(got, alone)


@f32_kernel
def test_the_float32_kernel_takes_any_layout_of_x_and_refuses_what_it_cannot_do() -> None:
    x = torch.randn(4, 3, 64).transpose(0, 1)  # not contiguous: copied, as F.linear would read it
    weight = torch.randn(8, 64)
    torch.testing.assert_close(native.f32_linear(x, weight, None), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    assert native.f32_linear(torch.randn(0, 64), weight, None).shape == (0, 8)
    empty_rows = native.f32_linear(torch.randn(2, 0), torch.randn(4, 0), torch.ones(4))
    assert torch.equal(empty_rows, torch.ones(2, 4))  # K = 0: the bias alone
    for x, weight, bias, match in [
        (torch.randn(2, 64), torch.randn(6, 64), None, "multiple of 4"),
        (torch.randn(2, 64), torch.randn(8, 32), None, "64 features, the weight 32"),
        (torch.randn(2, 64).double(), torch.randn(8, 64).double(), None, "float32 only"),
        (torch.randn(2, 64), torch.randn(64, 8).t(), None, "contiguous weight"),
        (torch.randn(2, 64), torch.randn(8, 64), torch.randn(4), r"bias \[N\]"),
    ]:
        with pytest.raises(RuntimeError, match=match):
            native.f32_linear(x, weight, bias)


@f32_kernel
def test_float32_layers_take_the_kernel_for_the_steps_it_is_for() -> None:
    """Steps of 1..MAX_ROWS tokens go to the kernel (its bits exactly), but short rows (a small model's)
    over more than F32_SHORT_ROW_TOKENS tokens and anything larger stay with MKL; N % 4 != 0 never takes
    it; use_f32_linear([]) takes nothing."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(F32_SHORT_ROW, 36), nn.Linear(36, 64), nn.Linear(64, 30))
    assert use_f32_linear(use_weight_major_linear(model)) == 2
    wide, short, odd = model
    assert (wide._kernel, short._kernel, odd._kernel) == (True, True, False)
    with torch.no_grad():
        for rows in (1, 2, F32_SHORT_ROW_TOKENS, F32_SHORT_ROW_TOKENS + 1, MAX_ROWS, MAX_ROWS + 1):
            x = torch.randn(rows, F32_SHORT_ROW)
            kernel = native.f32_linear(x, wide.weight, wide.bias)
            assert torch.equal(wide(x), kernel) == (rows <= MAX_ROWS), rows
            x = torch.randn(rows, 36)
            on_kernel = rows <= F32_SHORT_ROW_TOKENS
            assert torch.equal(short(x), native.f32_linear(x, short.weight, short.bias)) == on_kernel, rows
            if not on_kernel and rows <= MAX_ROWS:
                assert torch.equal(short(x), F.linear(x, short.weight, short.bias))
            x = torch.randn(rows, 64)
            torch.testing.assert_close(odd(x), F.linear(x, odd.weight, odd.bias), rtol=1e-5, atol=1e-5)
    x = torch.randn(3, F32_SHORT_ROW, requires_grad=True)  # autograd: torch's ops, which have a backward
    wide(x).sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    assert use_f32_linear([]) == 0
    assert avx512_kernel_takes(4) and avx512_kernel_takes(8192)
    assert not avx512_kernel_takes(30) and not avx512_kernel_takes(0)


def test_without_the_library_float32_layers_stay_on_mkl_and_the_log_says_why(monkeypatch, caplog) -> None:
    def unavailable(kernel_cache=None):
        raise native.KernelUnavailable("no compiler")

    monkeypatch.setattr(native, "load", unavailable)
    layers = use_weight_major_linear(nn.Sequential(nn.Linear(8, 8)))
    with caplog.at_level("INFO", logger="keepwarm_runtime.engine.cpu_linear"):
        assert use_f32_linear(layers) == 0
    assert not layers[0]._kernel
    why = "float32 linear layers stay on MKL: keepwarm's CPU library did not load (no compiler)"
    assert why in caplog.text


def _bf16_pair(bias: bool, seed: int = 0) -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(seed)
    plain = nn.Linear(256, 384, bias=bias).to(torch.bfloat16)
    layer = nn.Linear(256, 384, bias=bias).to(torch.bfloat16)
    layer.load_state_dict(plain.state_dict())
    return plain, layer


@native_bf16
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1,), (2,), (4, 1), (1, 7), (16,), (3, 21), (64,), (300,), (1, 1024)])
def test_a_packed_layer_computes_nn_linear_bit_for_bit(shape: tuple[int, ...], bias: bool) -> None:
    plain, layer = _bf16_pair(bias, seed=sum(shape))
    assert use_packed_linear(layer) == [layer] and isinstance(layer, PackedLinear)
    x = torch.randn(*shape, 256, dtype=torch.bfloat16)
    unpacked = layer(x)
    assert layer.pack() and layer._packed is not None
    packed = layer(x)
    want = plain(x)
    assert packed.shape == want.shape == (*shape, 384)
    assert torch.equal(unpacked, want) and torch.equal(packed, want)


@native_bf16
def test_a_replaced_weight_drops_its_packed_copy_and_computes_with_the_new_one() -> None:
    _, layer = _bf16_pair(bias=True)
    use_packed_linear(layer)
    layer.pack()
    new = torch.randn_like(layer.weight)
    layer.weight = nn.Parameter(new, requires_grad=False)  # as wake's fill_parameters does
    x = torch.randn(8, 256, dtype=torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, new, layer.bias)) and layer._packed is None
    assert layer.pack()
    assert torch.equal(layer(x), F.linear(x, new, layer.bias))


@native_bf16
def test_the_packer_packs_in_the_background_and_drop_lets_go() -> None:
    model = nn.Sequential(*(nn.Linear(128, 128).to(torch.bfloat16) for _ in range(6)))
    x = torch.randn(5, 128, dtype=torch.bfloat16)
    want = model(x)
    packer = LinearPacker(use_packed_linear(model))
    ours = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    packer.start()
    packer.thread.join(timeout=60)
    assert all(layer._packed is not None for layer in model)
    assert packer.niceness == PACKER_NICE  # behind the steps, on its own thread only
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == ours
    assert torch.equal(model(x), want)
    packer.drop()
    assert all(layer._packed is None for layer in model)


def test_only_plain_bfloat16_linears_become_packed_and_a_meta_weight_is_not_packed() -> None:
    class Other(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(4, 4), Other(4, 4).to(torch.bfloat16), nn.Linear(4, 4).to(torch.bfloat16))
    assert use_packed_linear(model) == [model[2]]
    assert [type(m).__name__ for m in model] == ["Linear", "Other", "PackedLinear"]
    assert list(model[2].state_dict()) == ["weight", "bias"]
    model[2].weight = nn.Parameter(
        torch.empty(4, 4, dtype=torch.bfloat16, device="meta"), requires_grad=False
    )
    assert model[2].pack() is False and model[2]._packed is None  # slept: nothing to pack


@native_bf16
def test_one_row_stays_nn_linear_where_the_packed_product_rounds_otherwise() -> None:
    # At this size oneDNN's one-row product on the packed weight differs from F.linear's in the last
    # bits; the layer must not, or a step's tokens would depend on whether packing had finished.
    torch.manual_seed(0)
    layer = nn.Linear(2048, 8192, bias=False).to(torch.bfloat16)
    weight = layer.weight.detach().clone()
    use_packed_linear(layer)
    layer.pack()
    for rows in (1, 2):
        x = torch.randn(rows, 2048, dtype=torch.bfloat16)
        assert torch.equal(layer(x), F.linear(x, weight))


def _within_one_ulp(
    got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> None:
    """Outputs within one bfloat16 ulp of the exact (float64) product, bar the float32 sums' own error
    (at most K * 2^-24 * sum|x * w|, textbook bound), which a few outputs in 1,000 may show."""
    exact = x.double() @ weight.double().T + (bias.double() if bias is not None else 0.0)
    ulp = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(2.0**-100))) - 7)
    sums = x.shape[-1] * 2.0**-24 * (x.double().abs() @ weight.double().abs().T)
    error = (got.double() - exact).abs()
    assert got.dtype == torch.bfloat16 and got.shape == exact.shape
    assert (error <= ulp + sums).all()
    assert (error <= ulp).double().mean() >= 0.999


@amx
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    "rows, out_features, in_features",
    # one and many token blocks (16 tokens each), both kernel forms (<= 32 and 33..64 rows) and the
    # pairs loop beyond, feature counts with and without a half block (N % 32 == 16), deep K
    [
        (1, 16, 32),
        (5, 48, 96),
        (16, 384, 768),
        (17, 64, 64),
        (32, 96, 256),
        (33, 48, 128),
        (48, 2048, 768),
        (64, 768, 2048),
        (65, 80, 64),
        (200, 384, 160),
    ],
)
def test_the_amx_kernel_is_within_one_ulp_of_the_exact_product(
    rows: int, out_features: int, in_features: int, bias: bool, threads: int
) -> None:
    torch.manual_seed(rows * 7 + out_features)
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
    weight = (torch.randn(out_features, in_features) / in_features**0.5).to(torch.bfloat16)
    b = torch.randn(out_features, dtype=torch.bfloat16) if bias else None
    with intra_op_threads(threads):
        got = native.amx_linear(x, weight, b)
    _within_one_ulp(got, x, weight, b)
    want = F.linear(x, weight, b)  # the same rounding but for the sums' order: nearly every output equal
    assert (got == want).float().mean() >= 0.99


@amx
def test_the_amx_kernel_keeps_leading_dims_and_reads_strided_activations() -> None:
    torch.manual_seed(1)
    weight = torch.randn(64, 96, dtype=torch.bfloat16)
    x = torch.randn(96, 3, 5, dtype=torch.bfloat16).permute(1, 2, 0)  # [3, 5, 96], not contiguous
    got = native.amx_linear(x, weight, None)
    assert got.shape == (3, 5, 64) and got.is_contiguous()
    _within_one_ulp(got.reshape(15, 64), x.reshape(15, 96), weight, None)
    assert native.amx_linear(x[:0], weight, None).shape == (0, 5, 64)


@amx
def test_the_amx_kernel_carries_nan_and_infinity_as_the_product_does() -> None:
    weight = torch.ones(16, 32, dtype=torch.bfloat16)
    x = torch.ones(3, 32, dtype=torch.bfloat16)
    x[0, 5] = float("nan")
    x[1, 0] = float("inf")
    x[2] = 3e38  # each product finite, their float32 sum not
    got = native.amx_linear(x, weight, None)
    assert got[0].isnan().all() and (got[1] == float("inf")).all() and (got[2] == float("inf")).all()


@amx
@pytest.mark.parametrize(
    "x, weight, match",
    [
        (torch.ones(2, 48, dtype=torch.bfloat16), torch.ones(16, 48, dtype=torch.bfloat16), "multiple of 32"),
        (
            torch.ones(2, 32, dtype=torch.bfloat16),
            torch.ones(24, 32, dtype=torch.bfloat16),
            "multiple of 32 and N of 16",
        ),
        (torch.ones(2, 0, dtype=torch.bfloat16), torch.ones(16, 0, dtype=torch.bfloat16), "multiple of 32"),
        (torch.ones(2, 32), torch.ones(16, 32), "bfloat16 only"),
        (torch.ones(2, 64, dtype=torch.bfloat16), torch.ones(16, 32, dtype=torch.bfloat16), "64 features"),
        (
            torch.ones(2, 32, dtype=torch.bfloat16),
            torch.ones(32, 16, dtype=torch.bfloat16).T,
            "contiguous weight",
        ),
    ],
)
def test_the_amx_kernel_refuses_what_it_does_not_take_by_name(x, weight, match: str) -> None:
    with pytest.raises(RuntimeError, match=match):
        native.amx_linear(x, weight, None)


@amx
def test_amx_takes_fitting_layers_up_to_its_rows_and_onednn_the_rest() -> None:
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(256, 384), nn.Linear(384, 40), nn.Linear(40, 64)).to(torch.bfloat16)
    weights = [layer.weight.detach().clone() for layer in model]
    layers = use_packed_linear(model)
    assert use_amx_linear(layers) == 1  # 384 x 256 fits; 40 out (N % 16) and 40 in (K % 32) do not
    assert [layer._amx for layer in layers] == [True, False, False]
    first = model[0]
    first.pack()
    for rows in (1, 7, AMX_MAX_ROWS, AMX_MAX_ROWS + 1, 200):
        x = torch.randn(rows, 256, dtype=torch.bfloat16)
        got = first(x)
        if rows <= AMX_MAX_ROWS:
            assert torch.equal(got, native.amx_linear(x, weights[0], first.bias))
        else:  # oneDNN's packed weight: F.linear's result bit for bit
            assert torch.equal(got, F.linear(x, weights[0], first.bias))
        x2 = torch.randn(rows, 384, dtype=torch.bfloat16)
        assert torch.equal(model[1](x2), F.linear(x2, weights[1], model[1].bias))
    assert use_amx_linear([]) == 0
    assert amx_takes(16, 32) and not amx_takes(16, 0) and not amx_takes(0, 32) and not amx_takes(24, 32)


def _silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(gate)
    getattr(torch.ops, native.OP_NAMESPACE).silu_and_mul(out, gate, up)
    return out


@amx
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 33, 48, 64, 65, 100])
@pytest.mark.parametrize("out_in", [(2048, 768), (48, 64), (16, 32)])
def test_the_gate_up_kernel_is_the_two_layers_and_silu_and_mul_bit_for_bit(
    rows: int, out_in: tuple[int, int], threads: int
) -> None:
    torch.manual_seed(rows)
    n, k = out_in
    gate, up = ((torch.randn(n, k) / k**0.5).to(torch.bfloat16) for _ in range(2))
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    with intra_op_threads(threads):
        got = native.amx_gate_up_silu(x, gate, up)
        want = _silu_and_mul(native.amx_linear(x, gate, None), native.amx_linear(x, up, None))
    assert torch.equal(got, want)
    exact = F.silu(x.float() @ gate.float().T) * (x.float() @ up.float().T)  # and near the exact value
    assert torch.allclose(got.float(), exact, rtol=0.05, atol=0.05)


@amx
def test_the_gate_up_kernel_keeps_leading_dims_and_refuses_by_name() -> None:
    gate, up = torch.ones(32, 64, dtype=torch.bfloat16), torch.ones(32, 64, dtype=torch.bfloat16)
    x = torch.randn(64, 2, 3, dtype=torch.bfloat16).permute(1, 2, 0)  # [2, 3, 64], not contiguous
    got = native.amx_gate_up_silu(x, gate, up)
    assert got.shape == (2, 3, 32) and torch.equal(got, native.amx_gate_up_silu(x.contiguous(), gate, up))
    assert native.amx_gate_up_silu(x[:0], gate, up).shape == (0, 3, 32)
    with pytest.raises(RuntimeError, match=r"amx_gate_up_silu: gate .* and up .* differ"):
        native.amx_gate_up_silu(x, gate, up[:16])
    with pytest.raises(RuntimeError, match="amx_gate_up_silu: K must be a multiple of 32"):
        native.amx_gate_up_silu(*(torch.ones(n, 48, dtype=torch.bfloat16) for n in (2, 32, 32)))
    with pytest.raises(RuntimeError, match="amx_gate_up_silu: bfloat16 only"):
        native.amx_gate_up_silu(x.float(), gate, up)


@amx
def test_gate_up_silu_takes_the_pair_only_where_nothing_watches_the_layers_one_at_a_time() -> None:
    torch.manual_seed(3)
    gate, up, odd = (nn.Linear(64, n, bias=False).to(torch.bfloat16) for n in (32, 32, 40))
    layers = use_packed_linear(nn.ModuleList([gate, up, odd]))
    use_amx_linear(layers)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        want = _silu_and_mul(gate(x), up(x))
        assert torch.equal(gate_up_silu(gate, up, x), want)
        assert gate_up_silu(gate, odd, x) is None  # shapes differ (and 40 outputs do not take the kernel)
        assert gate_up_silu(gate, up, torch.randn(AMX_MAX_ROWS + 1, 64, dtype=torch.bfloat16)) is None
        assert gate_up_silu(gate, up, x.float()) is None
        handle = up.register_forward_hook(lambda module, args, out: out * 2)  # as a LoRA slot's hook adds
        assert gate_up_silu(gate, up, x) is None
        handle.remove()
        handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda module, args: None)
        assert gate_up_silu(gate, up, x) is None
        handle.remove()
        plain = nn.Linear(64, 32, bias=False).to(torch.bfloat16)
        assert gate_up_silu(plain, up, x) is None  # not a PackedLinear
        gate.bias = nn.Parameter(torch.zeros(32, dtype=torch.bfloat16))
        assert gate_up_silu(gate, up, x) is None


@bf16_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    ("rows", "k", "n"),
    # a tile's 6 tokens and past them, K tails under a mask (odd K too: VDPBF16PS takes pairs) and
    # chunks of 2048 added in float32, features past a block's 32 and not a multiple of 16
    [(1, 96, 160), (5, 17, 4), (6, 32, 36), (7, 1, 8), (13, 1023, 68), (32, 2048 + 40, 32), (64, 4096, 100)],
)
def test_the_bf16_kernel_is_within_one_ulp_and_each_row_keeps_its_bits(rows, k, n, bias, threads) -> None:
    """Against the float64 product: within one bfloat16 ulp (bar the float32 sums' own error). Every row
    alone gives the bits it gets among the others (the sums' order depends on K only), and nearly every
    output equals F.linear's (the same rounding but for the sums' order)."""
    torch.manual_seed(rows * 1000 + k + bias)
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    weight = (torch.randn(n, k) / k**0.5).to(torch.bfloat16)
    b = torch.randn(n, dtype=torch.bfloat16) if bias else None
    with intra_op_threads(threads):
        got = native.bf16_linear(x, weight, b)
        alone = torch.cat([native.bf16_linear(x[i : i + 1], weight, b) for i in range(rows)])
    _within_one_ulp(got, x, weight, b)
    assert torch.equal(got, alone)
    assert (got == F.linear(x, weight, b)).float().mean() >= 0.99


@bf16_kernel
def test_the_bf16_kernel_takes_any_layout_of_x_carries_nan_and_refuses_by_name() -> None:
    torch.manual_seed(5)
    weight = torch.randn(8, 64, dtype=torch.bfloat16)
    x = torch.randn(4, 3, 64, dtype=torch.bfloat16).transpose(0, 1)  # not contiguous: copied
    got = native.bf16_linear(x, weight, None)
    assert got.shape == (3, 4, 8) and torch.equal(got, native.bf16_linear(x.contiguous(), weight, None))
    assert native.bf16_linear(x[:0], weight, None).shape == (0, 4, 8)
    empty_rows = native.bf16_linear(
        torch.ones(2, 0, dtype=torch.bfloat16), torch.ones(4, 0, dtype=torch.bfloat16), torch.ones(4)
    )
    assert empty_rows.dtype == torch.bfloat16 and torch.equal(
        empty_rows, torch.ones(2, 4, dtype=torch.bfloat16)
    )
    special = torch.ones(3, 64, dtype=torch.bfloat16)
    special[0, 5], special[1, 0], special[2] = (
        float("nan"),
        float("inf"),
        3e38,
    )  # the last: a float32 overflow
    out = native.bf16_linear(special, torch.ones(8, 64, dtype=torch.bfloat16), None)
    assert out[0].isnan().all() and (out[1] == float("inf")).all() and (out[2] == float("inf")).all()
    bf = torch.bfloat16
    for x, weight, bias, match in [
        (torch.ones(2, 64, dtype=bf), torch.ones(6, 64, dtype=bf), None, "multiple of 4"),
        (torch.ones(2, 64, dtype=bf), torch.ones(8, 32, dtype=bf), None, "64 features, the weight 32"),
        (torch.ones(2, 64), torch.ones(8, 64), None, "bfloat16 only"),
        (torch.ones(2, 64, dtype=bf), torch.ones(8, 64), None, "bfloat16 only"),
        (torch.ones(2, 64, dtype=bf), torch.ones(64, 8, dtype=bf).t(), None, "contiguous weight"),
        (torch.ones(2, 64, dtype=bf), torch.ones(8, 64, dtype=bf), torch.ones(4), r"bias \[N\]"),
    ]:
        with pytest.raises(RuntimeError, match=match):
            native.bf16_linear(x, weight, bias)


def test_the_bf16_kernel_takes_every_step_but_where_dot_products_run_at_the_fmas_rate() -> None:
    assert bf16_kernel_max_rows("GenuineIntel") is None and bf16_kernel_max_rows("") is None
    assert bf16_kernel_max_rows("AuthenticAMD") == FAST_DOT_KERNEL_MAX_ROWS == 2


@bf16_kernel
def test_bf16_layers_take_the_kernel_for_every_step_on_a_cpu_without_amx() -> None:
    """Every step, one row to a prefill chunk of several slabs of 256, goes to the kernel (its bits
    exactly) on a CPU whose dot products are slow (an Intel's); N % 4 != 0 never takes it and stays
    on oneDNN's packed weight (F.linear's bits); use_bf16_linear([]) takes nothing. On a CPU with AMX
    no layer takes it (a test below)."""
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(256, 384), nn.Linear(384, 36), nn.Linear(36, 30)).to(torch.bfloat16)
    weights = [layer.weight.detach().clone() for layer in model]
    layers = use_packed_linear(model)
    if native.amx_linear_available():
        assert use_bf16_linear(layers) == 0 and not any(layer._bf16 for layer in layers)
        return
    assert use_bf16_linear(layers, vendor="GenuineIntel") == 2
    assert [needs_packed_copy(layer) for layer in layers] == [False, False, True]
    assert [layer._bf16 for layer in layers] == [True, True, False]
    for layer in layers:
        layer.pack()
    with torch.no_grad():
        for rows in (1, 2, 128, 129, 600):
            x, x_odd = (
                torch.randn(rows, 384, dtype=torch.bfloat16),
                torch.randn(rows, 36, dtype=torch.bfloat16),
            )
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as ran:
                got, got_odd = model[1](x), model[2](x_odd)
            calls = {event.key: event.count for event in ran.key_averages()}
            assert calls.get("keepwarm_cpu::bf16_linear", 0) == 1, rows  # never for N % 4 != 0
            assert torch.equal(got, native.bf16_linear(x, weights[1], model[1].bias)), rows
            assert torch.equal(got_odd, F.linear(x_odd, weights[2], model[2].bias)), rows
            if rows > 1:  # the slabs of 256 rows: each row the bits it has alone
                alone = torch.cat(
                    [native.bf16_linear(x[i : i + 1], weights[1], model[1].bias) for i in (0, rows - 1)]
                )
                assert torch.equal(got[[0, rows - 1]], alone), rows
    assert use_bf16_linear([]) == 0


@bf16_kernel
def test_where_dot_products_run_at_the_fmas_rate_the_bf16_kernel_takes_few_rows_and_onednn_the_rest(
    caplog,
) -> None:
    """On a CPU of FAST_DOT_VENDORS (AMD's) steps of up to FAST_DOT_KERNEL_MAX_ROWS rows take the kernel
    (its bits), larger ones oneDNN's packed weight (F.linear's bits), so the layers need packing; the
    log says so once."""
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(256, 384)).to(torch.bfloat16)
    weight = model[0].weight.detach().clone()
    layers = use_packed_linear(model)
    if native.amx_linear_available():
        return  # AMX takes them (a test below)
    with caplog.at_level(logging.INFO, logger="keepwarm_runtime.engine.cpu_linear"):
        assert use_bf16_linear(layers, vendor="AuthenticAMD") == 1
    assert "up to 2 rows take the AVX-512 BF16 kernel" in caplog.text
    assert layers[0]._bf16_max_rows == FAST_DOT_KERNEL_MAX_ROWS and needs_packed_copy(layers[0])
    layers[0].pack()
    with torch.no_grad():
        for rows in (1, 2, 3, 64, 300):
            x = torch.randn(rows, 256, dtype=torch.bfloat16)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as ran:
                got = model[0](x)
            calls = {event.key: event.count for event in ran.key_averages()}
            on_kernel = rows <= FAST_DOT_KERNEL_MAX_ROWS
            assert calls.get("keepwarm_cpu::bf16_linear", 0) == int(on_kernel), rows
            want = (
                native.bf16_linear(x, weight, model[0].bias)
                if on_kernel
                else F.linear(x, weight, model[0].bias)
            )
            assert torch.equal(got, want), rows


def test_with_amx_tiles_bf16_layers_stay_off_the_avx512_kernel_and_the_log_says_why(
    monkeypatch, caplog
) -> None:
    monkeypatch.setattr(native, "load", lambda kernel_cache=None: "loaded")
    monkeypatch.setattr(native, "bf16_linear_available", lambda: True)
    monkeypatch.setattr(native, "amx_linear_available", lambda: True)
    layers = use_packed_linear(nn.Sequential(nn.Linear(8, 8).to(torch.bfloat16)))
    with caplog.at_level("INFO", logger="keepwarm_runtime.engine.cpu_linear"):
        assert use_bf16_linear(layers) == 0
    assert not layers[0]._bf16
    assert (
        "stay off the AVX-512 BF16 kernel: AMX tiles here: the AMX kernel and oneDNN take them" in caplog.text
    )


def test_without_the_library_bf16_layers_stay_on_onednn_and_the_log_says_why(monkeypatch, caplog) -> None:
    def unavailable(kernel_cache=None):
        raise native.KernelUnavailable("no compiler")

    monkeypatch.setattr(native, "load", unavailable)
    layers = use_packed_linear(nn.Sequential(nn.Linear(8, 8).to(torch.bfloat16)))
    with caplog.at_level("INFO", logger="keepwarm_runtime.engine.cpu_linear"):
        assert use_bf16_linear(layers) == 0
    assert not layers[0]._bf16
    why = "stay off the AVX-512 BF16 kernel: keepwarm's CPU library did not load (no compiler)"
    assert why in caplog.text
