"""engine/cpu_linear.py: the weight-major product equals nn.Linear's, and only plain float32 layers change."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from keepwarm_runtime.engine.cpu_linear import MAX_ROWS, WeightMajorLinear, use_weight_major_linear


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
