"""engine/cpu_linear.py: the weight-major product equals nn.Linear's, and only plain float32 layers
change; a packed bfloat16 layer computes nn.Linear's result bit for bit, packed or not."""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from keepwarm_runtime.engine.cpu_linear import (
    MAX_ROWS,
    PACKER_NICE,
    LinearPacker,
    PackedLinear,
    WeightMajorLinear,
    packed_weights_supported,
    use_packed_linear,
    use_weight_major_linear,
)

native_bf16 = pytest.mark.skipif(
    not packed_weights_supported(), reason="oneDNN has no native bfloat16 here (needs AVX-512 BF16 or AMX)"
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
    assert use_weight_major_linear(model) == 1
    assert [type(m).__name__ for m in model] == ["WeightMajorLinear", "Other", "Linear", "ReLU"]
    assert list(model[0].state_dict()) == ["weight", "bias"]


def test_a_bfloat16_input_is_refused_as_nn_linear_refuses_it() -> None:
    layer = nn.Linear(8, 8)
    use_weight_major_linear(layer)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    assert torch.equal(layer(x.float()), layer(x.float()))
    with pytest.raises(RuntimeError):  # F.linear's own refusal of mixed dtypes, not a silent cast
        layer(x)


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
