"""keepwarm's fused CPU kernels (csrc/fused_ops.cpp) against the torch expressions of transformers'
modules, and their attachment to modules (engine/cpu_fused.py).

Tolerance, bfloat16 and float16: the kernels round where the modules round, so an output may differ
from the module's by one unit in the last place of the 16-bit dtype (RMSNorm's sum of squares is
summed in another order, SiLU's exp is another float32 polynomial) and only rarely: at most 1 in 500
outputs here. float32: within 4 float32 ulps. Rotary is exact in
every dtype (the same products and sums, rounded at the same places)."""

from __future__ import annotations

import functools
import logging
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from keepwarm_runtime.engine import cpu_fused
from keepwarm_runtime.engine.attention import native

# hidden sizes: multiples of 16 (vector loops only), odd ones (a scalar tail) and smaller than a vector
SIZES = [768, 100, 17, 1]
ROWS = [1, 3, 257]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture(scope="module")
def ops():
    native.load()
    return getattr(torch.ops, native.OP_NAMESPACE)


def agree(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within the tolerance above: one ulp of the dtype, in few places (16-bit), or a few ulps (float32)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    eps = torch.finfo(got.dtype).eps
    got, want = got.double(), want.double()
    scale = want.abs().clamp_min(torch.finfo(torch.float32).tiny)
    off = (got - want).abs() > 1e-30
    assert ((got - want).abs() <= 4 * eps * scale + 1e-30).all(), float(((got - want).abs() / scale).max())
    if eps > 1e-6:  # 16-bit: rare
        assert off.float().mean() <= 1 / 500, int(off.sum())


def llama_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(x.shape[-1], eps).to(x.dtype)
    norm.weight.data.copy_(weight)
    return norm(x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("size", SIZES)
def test_rms_norm_matches_llamas_module(ops, dtype, rows, size) -> None:
    g = torch.Generator().manual_seed(size * rows)
    x = (torch.randn(rows, size, generator=g) * 3).to(dtype)
    weight = torch.randn(size, generator=g).to(dtype)
    out = torch.empty_like(x)
    ops.rms_norm(out, x, weight, 1e-5)
    agree(out, llama_rms_norm(x, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("size", SIZES)
def test_gemma_rms_norm_matches_gemmas_module(ops, dtype, rows, size) -> None:
    """Gemma's RMSNorm scales by ``1 + w`` in float32 and rounds once (Gemma 2's and 3's are it);
    weights near -1 make ``1 + w`` small, where the float32 steps show."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    g = torch.Generator().manual_seed(size * rows + 3)
    x = (torch.randn(rows, size, generator=g) * 3).to(dtype)
    weight = (torch.randn(size, generator=g) - 1).to(dtype)
    norm = GemmaRMSNorm(size, eps=1e-6).to(dtype)
    norm.weight.data.copy_(weight)
    out = torch.empty_like(x)
    ops.gemma_rms_norm(out, x, weight, 1e-6)
    agree(out, norm(x))
    assert not torch.equal(out, llama_rms_norm(x, weight, 1e-6)) or size == 1  # not Llama's


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("size", SIZES)
def test_add_rms_norm_matches_the_add_then_the_module(ops, dtype, rows, size) -> None:
    g = torch.Generator().manual_seed(size + rows)
    x, residual = (torch.randn(2, rows, size, generator=g) * 2).to(dtype)
    weight = torch.randn(size, generator=g).to(dtype)
    out, summed = torch.empty_like(x), torch.empty_like(x)
    ops.add_rms_norm(out, summed, x, residual, weight, 1e-6)
    want_sum = residual + x
    assert torch.equal(summed, want_sum)  # one rounding of an exact sum
    agree(out, llama_rms_norm(want_sum, weight, 1e-6))


def gemma_case(dtype: torch.dtype, rows: int, size: int, seed: int):
    """x, residual and two weights near -1 (where Gemma's ``1 + w`` is small and its float32 steps show)."""
    g = torch.Generator().manual_seed(seed)
    x, residual = (torch.randn(2, rows, size, generator=g) * 2).to(dtype)
    first, second = (torch.randn(2, size, generator=g) - 1).to(dtype)
    return x, residual, first, second


def gemma_norm_kernel(ops, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    ops.gemma_rms_norm(out, x, weight, eps)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("size", SIZES)
def test_add_gemma_rms_norm_matches_the_add_then_gemmas_module(ops, dtype, rows, size) -> None:
    """Gemma's layer (Llama's code): the residual add, then Gemma's RMSNorm of the sum."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    x, residual, weight, _ = gemma_case(dtype, rows, size, seed=size * rows + 7)
    out, summed = torch.empty_like(x), torch.empty_like(x)
    ops.add_gemma_rms_norm(out, summed, x, residual, weight, 1e-6)
    want_sum = residual + x
    assert torch.equal(summed, want_sum)
    assert torch.equal(out, gemma_norm_kernel(ops, want_sum, weight, 1e-6))
    norm = GemmaRMSNorm(size, eps=1e-6).to(dtype)
    norm.weight.data.copy_(weight)
    agree(out, norm(want_sum))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("size", SIZES)
def test_gemma_norm_add_norm_is_the_sandwich_of_gemma2s_layer(ops, dtype, rows, size) -> None:
    """The norm after a sublayer, the residual add and the norm before the next sublayer (and, without
    the last, the norm after the MLP and its add), rounded where Gemma 2's layer rounds: bit for bit the
    Gemma RMSNorm kernel (held to the module above) and torch's add, each eps its own."""
    x, residual, post, pre = gemma_case(dtype, rows, size, seed=size * rows + 11)
    out, summed = torch.empty_like(x), torch.empty_like(x)
    ops.gemma_norm_add_norm(out, summed, x, residual, post, 1e-6, pre, 1e-5)
    want_sum = residual + gemma_norm_kernel(ops, x, post, 1e-6)
    assert torch.equal(summed, want_sum)
    assert torch.equal(out, gemma_norm_kernel(ops, want_sum, pre, 1e-5))
    alone = torch.empty_like(x)
    ops.gemma_norm_add(alone, x, residual, post, 1e-6)
    assert torch.equal(alone, want_sum)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("size", SIZES)
def test_silu_and_mul_matches_silu_times_up(ops, dtype, rows, size) -> None:
    g = torch.Generator().manual_seed(size * 7 + rows)
    gate = (torch.randn(rows, size, generator=g) * 6).to(dtype)  # tails of the exp both ways
    up = torch.randn(rows, size, generator=g).to(dtype)
    out = torch.empty_like(gate)
    ops.silu_and_mul(out, gate, up)
    agree(out, F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("size", SIZES)
def test_silu_and_mul_halves_matches_phi3s_mlp(ops, dtype, rows, size) -> None:
    """One gate-and-up product's rows, the gate's half then the up's: ``up * silu(gate)`` as Phi-3's
    MLP computes it on the chunks (the same bits as ``silu_and_mul`` on the two halves)."""
    g = torch.Generator().manual_seed(size * 5 + rows)
    gate_up = (torch.randn(rows, 2 * size, generator=g) * 6).to(dtype)
    out = torch.empty(rows, size, dtype=dtype)
    ops.silu_and_mul_halves(out, gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    agree(out, up * F.silu(gate))
    halves = torch.empty_like(out)
    ops.silu_and_mul(halves, gate.contiguous(), up.contiguous())
    assert torch.equal(out, halves)


def test_silu_and_mul_at_the_ends_of_the_exp(ops) -> None:
    gate = torch.tensor([-200.0, -90.0, -88.0, -20.0, 0.0, 20.0, 88.0, 90.0, 200.0] * 2, dtype=torch.bfloat16)
    up = torch.ones_like(gate)
    out = torch.empty_like(gate)
    ops.silu_and_mul(out, gate, up)
    assert torch.allclose(out.float(), F.silu(gate.float()), atol=1e-30, rtol=2**-7)


def gelu_tanh_exact(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh form in float64, as the sigmoid it equals: the truth both sides are held to."""
    x = x.double()
    return x * torch.sigmoid(2 * 0.7978845608028654 * (x + 0.044715 * x**3))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("size", SIZES)
def test_gelu_tanh_and_mul_matches_gemmas_mlp_where_torch_is_exact(ops, dtype, rows, size) -> None:
    """``gelu(gate, approximate="tanh") * up`` as Gemma's MLP computes it, rounded where torch rounds.
    Where the gate is below -1 torch's ``1 + tanh`` cancels (1e-5 relative at -3, up to 100% below it:
    0 for gates below about -5.5); the kernel computes the sigmoid GELU's tanh form equals, so there it
    is held to float64's value instead (within the dtype's rounding), and torch's to within its
    cancellation, 2^-23 of the gate."""
    g = torch.Generator().manual_seed(size * 11 + rows)
    gate = (torch.randn(rows, size, generator=g) * 3).to(dtype)
    up = torch.randn(rows, size, generator=g).to(dtype)
    out = torch.empty_like(gate)
    ops.gelu_tanh_and_mul(out, gate, up)
    want = F.gelu(gate, approximate="tanh") * up
    body = gate.double() >= -1
    if body.any():
        agree(out[body], want[body])
    info = torch.finfo(dtype)
    eps, step = info.eps, info.smallest_normal * info.eps  # subnormals' spacing: float16's tail is there
    truth = gelu_tanh_exact(gate)  # the activation, then the product as torch rounds it
    act = truth.to(dtype).double() if dtype != torch.float32 else truth
    want_tail, tail = act * up.double(), ~body
    # float32 forms the exponent, 2k(g + 0.044715 g^3), to a few float32 ulps: e^x moves by |x| times
    # that; below e^-87.3 it is held at about 1e-38
    exponent = 2 * 0.7978845608028654 * (gate.double() + 0.044715 * gate.double() ** 3).abs()
    slack = (2 * eps + 2**-21 * exponent) * want_tail.abs() + 2 * step * (1 + up.double().abs()) + 1e-36
    assert ((out.double() - want_tail).abs() <= slack)[tail].all()
    slack = 2**-23 * (gate.double() * up.double()).abs() + 2 * eps * want.double().abs() + slack
    assert ((out.double() - want.double()).abs() <= slack).all()


def test_gelu_tanh_and_mul_is_exact_where_torchs_cancels(ops) -> None:
    gate = torch.tensor([-200.0, -90.0, -12.0, -6.0, -4.0, -3.0, 0.0, 3.0, 20.0, 90.0, 200.0] * 2)
    out = torch.empty_like(gate)
    ops.gelu_tanh_and_mul(out, gate, torch.ones_like(gate))
    truth = gelu_tanh_exact(gate)
    exponent = 2 * 0.7978845608028654 * (gate.double() + 0.044715 * gate.double() ** 3).abs()
    assert (
        (out.double() - truth).abs() <= (2**-22 + 2**-21 * exponent) * truth.abs() + 1e-35
    ).all()  # e^-87.3 at least
    assert F.gelu(gate[2:3], approximate="tanh").item() == 0.0 != out[2].item()  # torch's cancellation


def rotary_case(dtype, tokens: int, heads: int, kv_heads: int, dim: int, seed: int = 0):
    """q and k as transformers' attention makes them: [B, T, H, D] projections viewed as [B, H, T, D]."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, tokens, heads, dim, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(1, tokens, kv_heads, dim, generator=g).to(dtype).transpose(1, 2)
    angles = torch.randn(1, tokens, dim // 2, generator=g) * 10
    emb = torch.cat((angles, angles), dim=-1)
    return q, k, emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 5, 70])
@pytest.mark.parametrize("dim", [64, 128, 18, 2])
def test_rotary_is_transformers_apply_rotary_pos_emb_exactly(ops, dtype, tokens, dim) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k, cos, sin = rotary_case(dtype, tokens, heads=6, kv_heads=2, dim=dim, seed=tokens + dim)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = torch.empty_like(q), torch.empty_like(k)
    ops.rotary_embedding(got_q, got_k, q, k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    # and from contiguous [B, H, T, D] inputs
    got_q = torch.empty_like(q.contiguous())
    ops.rotary_embedding(got_q, torch.empty_like(k), q.contiguous(), k, cos, sin)
    assert torch.equal(got_q, want_q)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("dim", "rotary_dims"), [(128, 96), (96, 32), (64, 64), (18, 6), (8, 2)])
@pytest.mark.parametrize("reference", ["phi3", "glm4_moe"])
def test_partial_rotary_is_phi3s_and_glm45s_apply_rotary_pos_emb_exactly(
    ops, dtype, dim, rotary_dims, reference
) -> None:
    """Phi-3's and GLM-4.5's (Phi-4-mini: 96 of 128 dims; GLM-4.5: half) rotate cos's width of each head
    and pass the rest."""
    import importlib

    module = importlib.import_module(f"transformers.models.{reference}.modeling_{reference}")
    apply_rotary_pos_emb = module.apply_rotary_pos_emb

    q, k, cos, sin = rotary_case(dtype, 7, heads=6, kv_heads=2, dim=rotary_dims, seed=dim)
    q = torch.randn(1, 7, 6, dim).to(dtype).transpose(1, 2)
    k = torch.randn(1, 7, 2, dim).to(dtype).transpose(1, 2)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = torch.empty_like(q), torch.empty_like(k)
    ops.rotary_embedding(got_q, got_k, q, k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("dim", "rotary_dims"), [(128, 64), (64, 64), (18, 6), (8, 2)])
@pytest.mark.parametrize("reference", ["glm", "glm4"])
def test_pairs_rotary_is_glms_apply_rotary_pos_emb_exactly(ops, dtype, dim, rotary_dims, reference) -> None:
    """GLM's (and GLM 4's: half of each head) turns its first dims in pairs (x[2i], x[2i + 1]), angle i
    from cos's first half, and passes the rest."""
    import importlib

    module = importlib.import_module(f"transformers.models.{reference}.modeling_{reference}")
    _, _, cos, sin = rotary_case(dtype, 7, heads=6, kv_heads=2, dim=rotary_dims, seed=dim + 1)
    g = torch.Generator().manual_seed(dim)
    q = torch.randn(1, 7, 6, dim, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(1, 7, 2, dim, generator=g).to(dtype).transpose(1, 2)
    want_q, want_k = module.apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = torch.empty_like(q), torch.empty_like(k)
    ops.rotary_embedding_pairs(got_q, got_k, q, k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    halves_q = torch.empty_like(q)  # the halves' kernel computes something else (but for one pair)
    ops.rotary_embedding(halves_q, torch.empty_like(k), q, k, cos, sin)
    assert torch.equal(halves_q, want_q) == (rotary_dims == 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 5, 70])
@pytest.mark.parametrize("dim", [64, 32, 18, 2])
def test_interleaved_rotary_is_deepseek_v3s_exactly(ops, dtype, tokens, dim) -> None:
    """DeepSeek-V3's apply_rotary_pos_emb_interleave: pairs turned by one angle each, written out as
    halves; its MLA attention's keys are one head ([B, 1, T, D], as its rotary key's view)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    q, k, cos, sin = rotary_case(dtype, tokens, heads=4, kv_heads=1, dim=dim, seed=tokens * dim + 5)
    want_q, want_k = apply_rotary_pos_emb_interleave(q, k, cos, sin)
    got_q, got_k = torch.empty_like(q), torch.empty_like(k)
    ops.rotary_embedding_interleave(got_q, got_k, q, k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    fused = cpu_fused.fused_rotary(apply_rotary_pos_emb_interleave, cpu_fused.INTERLEAVE_NAME)
    assert all(torch.equal(a, b) for a, b in zip(fused(q, k, cos, sin), (want_q, want_k), strict=True))
    halves_q, _ = cpu_fused.fused_rotary(apply_rotary_pos_emb_interleave, "attention")(q, k, cos, sin)
    if dim > 2:
        assert not torch.equal(halves_q, want_q)  # Llama's layout is another computation
        with pytest.raises(RuntimeError, match="span the head"):
            ops.rotary_embedding_interleave(got_q, got_k, q, k, cos[..., :2], sin[..., :2])


def test_inputs_the_kernels_cannot_take_are_named_refusals(ops) -> None:
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    weight = torch.ones(32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.rms_norm(torch.empty(32, 4, dtype=torch.bfloat16).t(), x.t().contiguous().t(), weight, 1e-6)
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.rms_norm(torch.empty_like(x), torch.randn(32, 8, dtype=torch.bfloat16)[:, ::2], weight, 1e-6)
    with pytest.raises(RuntimeError, match="one dtype"):
        ops.rms_norm(torch.empty_like(x), x, weight.float(), 1e-6)
    with pytest.raises(RuntimeError, match="weight"):
        ops.rms_norm(torch.empty_like(x), x, weight[:16], 1e-6)
    with pytest.raises(RuntimeError, match="weight"):
        ops.gemma_rms_norm(torch.empty_like(x), x, weight[:16], 1e-6)
    with pytest.raises(RuntimeError, match="one dtype"):
        ops.gemma_rms_norm(torch.empty_like(x), x, weight.float(), 1e-6)
    with pytest.raises(RuntimeError, match="one shape"):
        ops.silu_and_mul(torch.empty_like(x), x, x[:2])
    with pytest.raises(RuntimeError, match="even"):
        ops.silu_and_mul_halves(torch.empty(4, 16, dtype=torch.bfloat16), torch.randn(4, 31).bfloat16())
    with pytest.raises(RuntimeError, match="half its last dim"):
        ops.silu_and_mul_halves(torch.empty_like(x), x)
    with pytest.raises(RuntimeError, match="one dtype"):
        ops.silu_and_mul_halves(torch.empty(4, 16), x)
    q, k, cos, sin = rotary_case(torch.bfloat16, 3, 4, 2, 16)
    with pytest.raises(RuntimeError, match="disagree"):
        ops.rotary_embedding(torch.empty_like(q), torch.empty_like(k), q, k, cos[:, :2], sin[:, :2])
    with pytest.raises(RuntimeError, match="even and at most the head dim"):
        odd = torch.randn(1, 4, 3, 5, dtype=torch.bfloat16)
        ops.rotary_embedding(torch.empty_like(odd), torch.empty_like(odd), odd, odd, odd[:, 0], odd[:, 0])
    wide = torch.randn(1, 3, 18, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="even and at most the head dim"):
        ops.rotary_embedding(torch.empty_like(q), torch.empty_like(k), q, k, wide, wide)
    with pytest.raises(RuntimeError, match="one shape"):
        ops.gelu_tanh_and_mul(torch.empty_like(x), x, x[:2])
    with pytest.raises(RuntimeError, match="one dtype"):
        ops.gelu_tanh_and_mul(torch.empty_like(x), x, x.float())
    out, summed = torch.empty_like(x), torch.empty_like(x)
    with pytest.raises(RuntimeError, match="weight"):
        ops.gemma_norm_add_norm(out, summed, x, x, weight, 1e-6, weight[:16], 1e-6)
    with pytest.raises(RuntimeError, match="one shape"):
        ops.gemma_norm_add(summed, x, x[:2], weight, 1e-6)
    with pytest.raises(RuntimeError, match="share one dtype"):
        ops.add_gemma_rms_norm(out, summed, x, x.float(), weight, 1e-6)
    with pytest.raises(RuntimeError, match="out"):
        ops.gemma_norm_add_norm(out[:2], summed, x, x, weight, 1e-6, weight, 1e-6)


# The attachment: module forwards against the unfused modules, and where the fused ones step aside.


def tiny_llama(dtype: torch.dtype, hidden: int = 48, act: str = "silu"):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=hidden,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_act=act,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(dtype).eval()


def test_fused_modules_agree_with_the_unfused_model_in_bfloat16() -> None:
    plain = tiny_llama(torch.bfloat16)
    fused = tiny_llama(torch.bfloat16)
    attached = cpu_fused.use_fused_ops(fused, torch.bfloat16)
    assert attached.counts == {"rms_norm": 5, "mlp": 2, "attention": 2, "decoder_layer": 2}
    ids = torch.randint(0, 64, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want, got = plain(ids).logits, fused(ids).logits
    # the logits: within 2 bfloat16 ulps of the largest (a norm's 1-ulp change moves them all a little)
    assert (got.float() - want.float()).abs().max() <= 2 * 2**-8 * want.float().abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_fused_modules_call_the_kernels_and_the_originals_stay(monkeypatch) -> None:
    from transformers.models.llama import modeling_llama

    model = tiny_llama(torch.bfloat16)
    original_rotary = modeling_llama.apply_rotary_pos_emb
    cpu_fused.use_fused_ops(model, torch.bfloat16)
    calls: list[str] = []
    real = native.op

    def counting(name: str):
        calls.append(name)
        return real(name)

    monkeypatch.setattr(native, "op", counting)
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3]]))
    assert sorted(set(calls)) == ["add_rms_norm", "rms_norm", "rotary_embedding", "silu_and_mul"]
    assert calls.count("rotary_embedding") == 2 and calls.count("add_rms_norm") == 2
    assert modeling_llama.apply_rotary_pos_emb is original_rotary  # transformers' module untouched
    assert type(tiny_llama(torch.bfloat16).model.norm) is modeling_llama.LlamaRMSNorm


def test_inputs_the_kernels_do_not_take_go_to_the_modules_own_forward(monkeypatch) -> None:
    model = tiny_llama(torch.bfloat16)
    cpu_fused.use_fused_ops(model, torch.bfloat16)
    monkeypatch.setattr(native, "op", lambda name: pytest.fail(f"kernel {name} was called"))
    norm = model.model.norm
    x = torch.randn(4, 96).to(torch.bfloat16)[:, ::2]  # not contiguous
    assert torch.equal(norm(x), super(type(norm), norm).forward(x))
    assert norm(x.float()).dtype == torch.float32  # another dtype: the module's promotion
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 48, requires_grad=True).to(torch.bfloat16)
    assert mlp(x).requires_grad  # autograd: the module's own


def test_float32_models_take_the_kernels_and_other_activations_keep_their_mlps() -> None:
    from transformers.models.llama import modeling_llama

    model = tiny_llama(torch.float32)
    attached = cpu_fused.use_fused_ops(model, torch.float32)
    assert attached.counts == {"rms_norm": 5, "mlp": 2, "attention": 2, "decoder_layer": 2}
    assert type(model.model.norm) is not modeling_llama.LlamaRMSNorm
    model = tiny_llama(torch.bfloat16, act="gelu")
    attached = cpu_fused.use_fused_ops(model, torch.bfloat16)
    assert "mlp" not in attached.counts and attached.counts["rms_norm"] == 5
    assert type(model.model.layers[0].mlp) is modeling_llama.LlamaMLP
    assert cpu_fused.use_fused_ops(tiny_llama(torch.float64), torch.float64).total == 0  # not a kernel dtype


def test_a_partial_rotary_model_rotates_on_the_kernel(monkeypatch) -> None:
    """Phi-3 with half of each head rotated (Phi-4-mini rotates 96 of 128 dims): the kernel takes the
    rotary, and the model's logits are the unfused model's exactly in float32 (rotary is exact; the
    norms and the activation round alike here, so within their float32 ulps)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )
    torch.manual_seed(0)
    plain = Phi3ForCausalLM(config).eval()
    fused = Phi3ForCausalLM(config).eval()
    fused.load_state_dict(plain.state_dict())
    assert cpu_fused.use_fused_ops(fused, torch.float32).counts["partial_rotary_attention"] == 2
    calls: list[str] = []
    real = native.op
    monkeypatch.setattr(native, "op", lambda name: calls.append(name) or real(name))
    ids = torch.randint(
        0, 64, (1, 9), generator=torch.Generator().manual_seed(3)
    )  # one row, as the engine packs
    with torch.inference_mode():
        want, got = plain(ids).logits, fused(ids).logits
    assert calls.count("rotary_embedding") == 2
    assert torch.allclose(got, want, rtol=0, atol=1e-5)


def test_fusing_twice_changes_nothing_the_second_time() -> None:
    model = tiny_llama(torch.bfloat16)
    assert cpu_fused.use_fused_ops(model, torch.bfloat16).total == 11
    classes = [type(m) for m in model.modules()]
    assert cpu_fused.use_fused_ops(model, torch.bfloat16).total == 0
    assert [type(m) for m in model.modules()] == classes


def test_without_the_library_nothing_changes_and_the_log_says_why(monkeypatch, caplog) -> None:
    def unavailable(kernel_cache=None):
        raise native.KernelUnavailable("no compiler")

    monkeypatch.setattr(native, "load", unavailable)
    model = tiny_llama(torch.bfloat16)
    with caplog.at_level(logging.INFO, logger=cpu_fused.__name__):
        assert cpu_fused.use_fused_ops(model, torch.bfloat16).total == 0
    assert not any(type(m) in cpu_fused.FUSED_KINDS for m in model.modules())
    assert [r.getMessage() for r in caplog.records if "fused" in r.getMessage()] == [
        "fused CPU kernels off, keepwarm's CPU library cannot be built here: no compiler"
    ]


L4 = ("RMSNorm", "MLP", "Attention", "DecoderLayer")  # Llama's four module classes, by name suffix
PARTIAL = cpu_fused.PARTIAL_ROTARY
PAIRS = cpu_fused.PAIRS_ROTARY
SANDWICH = "sandwich_layer"
# Architectures people run and what their classes compute, found by code (cpu_fused.module_kind's
# class part): a transformers release that changes one fails here rather than silently not fusing it.
KNOWN_ARCHITECTURES = {
    "llama": ("Llama", dict(zip(L4, ("rms_norm", "mlp", "attention", "decoder_layer"), strict=True))),
    **{
        name: (prefix, dict(zip(L4, ("rms_norm", "mlp", "attention", "decoder_layer"), strict=True)))
        for name, prefix in [
            ("mistral", "Mistral"),
            ("ministral", "Ministral"),
            ("ministral3", "Ministral3"),
            ("qwen2", "Qwen2"),
            ("qwen2_moe", "Qwen2Moe"),
            ("qwen3", "Qwen3"),
            ("qwen3_moe", "Qwen3Moe"),
            ("smollm3", "SmolLM3"),
            ("olmoe", "Olmoe"),
            ("hunyuan_v1_dense", "HunYuanDenseV1"),
            ("exaone_moe", "ExaoneMoe"),
        ]
    },
    "mixtral": ("Mixtral", {"RMSNorm": "rms_norm", "Attention": "attention", "DecoderLayer": None}),
    "granite": (
        "Granite",
        {"RMSNorm": "rms_norm", "MLP": "mlp", "Attention": "attention", "DecoderLayer": None},
    ),
    "phi3": (
        "Phi3",
        {
            "RMSNorm": "rms_norm",
            "MLP": "gate_up_mlp",
            "Attention": "partial_rotary_attention",
            "DecoderLayer": None,
        },
    ),
    "glm": (
        "Glm",
        {"RMSNorm": "rms_norm", "MLP": "gate_up_mlp", "Attention": PAIRS, "DecoderLayer": "decoder_layer"},
    ),
    "glm4": ("Glm4", {"RMSNorm": "rms_norm", "MLP": "gate_up_mlp", "Attention": PAIRS, "DecoderLayer": None}),
    "deepseek_v3": (
        "DeepseekV3",
        dict(zip(L4, ("rms_norm", "mlp", "attention", "decoder_layer"), strict=True)),
    ),
    "gemma": ("Gemma", dict(zip(L4, ("gemma_rms_norm", "mlp", "attention", "decoder_layer"), strict=True))),
    "gemma2": (
        "Gemma2",
        {"RMSNorm": "gemma_rms_norm", "MLP": "mlp", "Attention": "attention", "DecoderLayer": SANDWICH},
    ),
    "gemma3": (
        "Gemma3",
        {"RMSNorm": "gemma_rms_norm", "MLP": "mlp", "Attention": "attention", "DecoderLayer": SANDWICH},
    ),
    "starcoder2": ("Starcoder2", {"Attention": "attention", "MLP": None}),
    "glm4_moe": ("Glm4Moe", {**dict(zip(L4, ("rms_norm", "mlp", PARTIAL, "decoder_layer"), strict=True))}),
    "gpt_neox": ("GPTNeoX", {"Attention": PARTIAL, "MLP": None}),
    "qwen2_vl": (
        "Qwen2VL",
        {"RMSNorm": "rms_norm", "Attention": "attention", "DecoderLayer": "decoder_layer"},
    ),
    "exaone4": (
        "Exaone4",
        {"RMSNorm": "rms_norm", "MLP": "mlp", "Attention": "attention", "DecoderLayer": None},
    ),
}


def class_kind(cls: type) -> str | None:
    """What ``cls`` computes, by its code alone (no instance: no activation or norm looked at)."""
    kinds = [kind for kind in cpu_fused.REFERENCES if cpu_fused.computes(cls, kind)]
    if (rotary := cpu_fused.rotary_kind(cls)) is not None:
        kinds.append(rotary)
    assert len(kinds) <= 1, (cls, kinds)
    return kinds[0] if kinds else None


@pytest.mark.parametrize("name", sorted(KNOWN_ARCHITECTURES))
def test_known_architectures_modules_compute_what_the_kernels_do(name) -> None:
    import importlib

    prefix, kinds = KNOWN_ARCHITECTURES[name]
    module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    got = {suffix: class_kind(getattr(module, prefix + suffix)) for suffix in kinds}
    assert got == kinds


def test_same_computation_is_the_code_not_the_name_or_docstring() -> None:
    def norm(x, eps=1e-6):
        """One docstring."""
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def other_name(x, eps=1e-6):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def another_constant(x, eps=1e-6):
        return x * torch.rsqrt(x.pow(2).mean(-2, keepdim=True) + eps)

    def another_default(x, eps=1e-5):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    assert cpu_fused.same_computation(norm, other_name)
    assert not cpu_fused.same_computation(norm, another_constant)
    assert not cpu_fused.same_computation(norm, another_default)
    assert not cpu_fused.same_computation(norm, torch.rsqrt)  # not a Python function: unsure, so no
    # a global it reads that computes something else
    scope = {"torch": types.SimpleNamespace(rsqrt=torch.sqrt)}
    swapped = types.FunctionType(other_name.__code__, scope, "n", other_name.__defaults__)
    assert not cpu_fused.same_computation(norm, swapped)
    scope["torch"] = torch
    assert cpu_fused.same_computation(norm, swapped)


def test_a_rotary_whose_helper_differs_is_not_llamas() -> None:
    from transformers.models.llama import modeling_llama

    rotary = cpu_fused.plain_function(modeling_llama.apply_rotary_pos_emb)
    assert rotary is not None
    scope = dict(rotary.__globals__)
    scope["rotate_half"] = lambda x: torch.cat((x[..., 1::2], -x[..., ::2]), dim=-1)  # interleaved
    interleaved = types.FunctionType(rotary.__code__, scope, rotary.__name__, rotary.__defaults__)
    assert cpu_fused.same_computation(rotary, rotary) and not cpu_fused.same_computation(rotary, interleaved)
    from transformers.models.glm import modeling_glm  # pairs: a reference of its own, not Llama's

    assert cpu_fused.rotary_kind(modeling_glm.GlmAttention) == PAIRS


def test_a_module_that_changes_the_computation_is_not_fused() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class Offset(LlamaRMSNorm):
        def forward(self, hidden_states):
            return super().forward(hidden_states) + 1

    assert cpu_fused.module_kind(LlamaRMSNorm(8)) == "rms_norm"
    assert cpu_fused.module_kind(Offset(8)) is None
    # Llama's code, but a weight that broadcasts or an eps that is not a number: the kernel's [hidden]
    # weight and float eps do not fit, so the module keeps its own forward
    assert cpu_fused.module_kind(LlamaRMSNorm(1)) is None
    tensor_eps = LlamaRMSNorm(8)
    tensor_eps.variance_epsilon = torch.tensor(1e-6)
    assert cpu_fused.module_kind(tensor_eps) is None


def test_gemmas_layers_take_the_add_and_norm_kernels_of_gemmas_norm() -> None:
    """Gemma's decoder layer has Llama's forward with Gemma's ``1 + w`` norm: the fused add takes
    Gemma's kernel. Gemma 2's and 3's put a norm after each sublayer (the sandwich kind); one whose
    norm is not Gemma's keeps its own forward."""
    from transformers import Gemma2Config, Gemma3TextConfig, GemmaConfig
    from transformers.models.gemma.modeling_gemma import GemmaDecoderLayer
    from transformers.models.gemma2.modeling_gemma2 import Gemma2DecoderLayer
    from transformers.models.gemma3.modeling_gemma3 import Gemma3DecoderLayer
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    sizes = {"hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 2, "num_key_value_heads": 1}
    layer = GemmaDecoderLayer(GemmaConfig(head_dim=16, **sizes), 0)
    assert class_kind(GemmaDecoderLayer) == "decoder_layer"
    assert cpu_fused.module_kind(layer) == "gemma_decoder_layer"
    assert cpu_fused.module_kind(layer.mlp) == "gelu_tanh_mlp"  # its activation: GELU's tanh form
    for cls, config in [(Gemma2DecoderLayer, Gemma2Config), (Gemma3DecoderLayer, Gemma3TextConfig)]:
        layer = cls(config(head_dim=16, **sizes), 0)
        assert cpu_fused.module_kind(layer) == SANDWICH
        layer.post_feedforward_layernorm = LlamaRMSNorm(32)
        assert cpu_fused.module_kind(layer) is None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_fused_sandwich_layer_agrees_with_gemma3s_own(dtype, monkeypatch) -> None:
    """Gemma 3's layer, fused (its norms and the two sandwich kernels) against its own forward on the
    same weights: float32 within the kernels' few ulps, 16-bit within a few of its ulps."""
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3DecoderLayer

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        hidden_size=64, intermediate_size=96, num_attention_heads=2, num_key_value_heads=1, head_dim=32
    )
    config._attn_implementation = "eager"
    plain = Gemma3DecoderLayer(config, 0).to(dtype).eval()
    for name in ("input_layernorm", *cpu_fused.SANDWICH_NORMS):
        getattr(plain, name).weight.data.normal_(0, 0.5)
    fused = Gemma3DecoderLayer(config, 0).to(dtype).eval()
    fused.load_state_dict(plain.state_dict())
    assert cpu_fused.use_fused_ops(fused, dtype).counts.get(SANDWICH) == 1
    x = torch.randn(1, 5, 64).to(dtype)
    cos, sin = torch.randn(2, 1, 5, 32).to(dtype)
    called: set[str] = set()
    real = native.op
    monkeypatch.setattr(native, "op", lambda name: called.add(name) or real(name))
    with torch.no_grad():
        got = fused(x, position_embeddings=(cos, sin))
        want = plain(x, position_embeddings=(cos, sin))
    assert {"gemma_norm_add_norm", "gemma_norm_add"} <= called
    tolerance = (1e-5 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps) * want.abs().max().item()
    assert (got.double() - want.double()).abs().max().item() <= tolerance


def test_the_mlp_kernel_follows_the_activation() -> None:
    from transformers.activations import ACT2FN

    model = tiny_llama(torch.float32)
    mlp = model.model.layers[0].mlp
    for act, kind in [
        ("silu", "mlp"),
        ("gelu_pytorch_tanh", "gelu_tanh_mlp"),
        ("gelu_python_tanh", None),  # its Python form rounds at every operator
        ("gelu", None),
        ("relu", None),
    ]:
        mlp.act_fn = ACT2FN[act]
        assert cpu_fused.module_kind(mlp) == kind, act
    mlp.act_fn = nn.GELU(approximate="tanh")
    assert cpu_fused.module_kind(mlp) == "gelu_tanh_mlp"


def test_the_fused_attention_keeps_the_source_the_attention_fuser_reads() -> None:
    from transformers.models.llama.modeling_llama import LlamaAttention as attention

    from keepwarm_runtime.engine.attention.fuser import analyze_class

    fused = cpu_fused.fused_class(attention, "attention")
    got, want = analyze_class(fused), analyze_class(attention)
    assert (
        (got.scaling_kind, got.scaling_value)
        == (want.scaling_kind, want.scaling_value)
        == ("attr", "scaling")
    )


def test_a_llama_imports_no_other_reference(monkeypatch) -> None:
    """References are imported only for modules that have their attributes: a Llama needs Llama's."""
    import sys

    for name in (cpu_fused.GEMMA, cpu_fused.PHI3):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(cpu_fused, "computes", functools.cache(cpu_fused.computes.__wrapped__))
    monkeypatch.setattr(cpu_fused, "rotary_kind", functools.cache(cpu_fused.rotary_kind.__wrapped__))
    model = tiny_llama(torch.float32)
    assert {cpu_fused.module_kind(m) for m in model.modules()} >= {
        "rms_norm",
        "mlp",
        "attention",
        "decoder_layer",
    }
    assert cpu_fused.GEMMA not in sys.modules and cpu_fused.PHI3 not in sys.modules


def test_a_forward_without_the_rotary_global_is_not_fused() -> None:
    class NoRotary(nn.Module):
        def forward(self, x):
            return x

    assert cpu_fused.rotary_kind(NoRotary) is None and cpu_fused.module_kind(NoRotary()) is None
