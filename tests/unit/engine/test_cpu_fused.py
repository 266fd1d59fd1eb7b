"""keepwarm's fused CPU kernels (csrc/fused_ops.cpp) against the torch expressions of transformers'
modules, and their attachment to modules (engine/cpu_fused.py).

Tolerance, bfloat16 and float16: the kernels round where the modules round, so an output may differ
from the module's by one unit in the last place of the 16-bit dtype (RMSNorm's sum of squares is
summed in another order, SiLU's exp is another float32 polynomial) and only rarely: at most 1 in 500
outputs here. float32: within 4 float32 ulps. Rotary is exact in
every dtype (the same products and sums, rounded at the same places)."""

from __future__ import annotations

import ast
import inspect
import logging

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
    with pytest.raises(RuntimeError, match="even"):
        odd = torch.randn(1, 4, 3, 5, dtype=torch.bfloat16)
        ops.rotary_embedding(torch.empty_like(odd), torch.empty_like(odd), odd, odd, odd[:, 0], odd[:, 0])


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


def test_without_the_library_nothing_changes_and_the_log_says_why(monkeypatch, caplog) -> None:
    def unavailable(kernel_cache=None):
        raise native.KernelUnavailable("no compiler")

    monkeypatch.setattr(native, "load", unavailable)
    model = tiny_llama(torch.bfloat16)
    with caplog.at_level(logging.INFO, logger=cpu_fused.__name__):
        assert cpu_fused.use_fused_ops(model, torch.bfloat16).total == 0
    assert not any(type(m).__name__.startswith("KeepwarmFused") for m in model.modules())
    assert [r.getMessage() for r in caplog.records if "fused" in r.getMessage()] == [
        "fused CPU kernels off, keepwarm's CPU library cannot be built here: no compiler"
    ]


def _rotary_source(attention: type) -> str:
    """The source of the rotary function ``attention``'s module defines (``kernels`` may wrap it in a
    module object, whose source is not the function's)."""
    module = inspect.getmodule(attention)
    tree = ast.parse(inspect.getsource(module))
    (node,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == cpu_fused.ROTARY_NAME]
    node.decorator_list = []
    return ast.unparse(node)


def _forward_source(cls: type) -> str:
    return inspect.getsource(inspect.unwrap(cls.forward))


def _reference(kind: str) -> tuple[type, str]:
    """The module class whose computation ``kind``'s kernel reproduces, and its family's prefix."""
    name, prefix, kinds = next(e for e in cpu_fused.FAMILY_MODULES if dict(e[2]).get(kind))
    return cpu_fused.family(name, prefix, kinds).classes[kind], prefix


def _computation(cls: type, kind: str) -> str:
    """The source that says what a module of ``kind`` computes: its forward, or the whole class for
    Gemma's RMSNorm (whose forward calls its ``_norm``)."""
    return inspect.getsource(cls) if kind == "gemma_rms_norm" else _forward_source(cls)


@pytest.mark.parametrize(
    ("module", "prefix", "kinds"), cpu_fused.FAMILY_MODULES, ids=[e[1] for e in cpu_fused.FAMILY_MODULES]
)
def test_every_family_computes_what_the_kernels_do(module, prefix, kinds) -> None:
    """A family is fused only while its modules compute what Llama's (or Gemma's RMSNorm) do, names
    aside: a transformers release that changes one fails here rather than computing something else."""
    llama_attention = _reference("attention")[0]
    other = cpu_fused.family(module, prefix, kinds)
    for kind, cls in other.classes.items():
        if kind != "attention":
            reference, reference_prefix = _reference(kind)
            want = _computation(reference, kind)
            assert _computation(cls, kind).replace(prefix, reference_prefix) == want, f"{prefix} {kind}"
    # attention: only its rotary is fused, the function its forward calls by name
    if (attention := other.classes.get("attention")) is not None:
        assert _rotary_source(attention) == _rotary_source(llama_attention)
        call = "query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)"
        assert call in _forward_source(attention)
    llama_layer = _forward_source(_reference("decoder_layer")[0])
    assert "hidden_states = residual + hidden_states" in llama_layer
    assert "self.post_attention_layernorm(hidden_states)" in llama_layer


def test_the_fused_attention_keeps_the_source_the_attention_fuser_reads() -> None:
    from keepwarm_runtime.engine.attention.fuser import analyze_class

    attention = _reference("attention")[0]
    fused = cpu_fused.fused_class(attention, "attention")
    assert fused is not None
    got, want = analyze_class(fused), analyze_class(attention)
    assert (
        (got.scaling_kind, got.scaling_value)
        == (want.scaling_kind, want.scaling_value)
        == ("attr", "scaling")
    )


def test_only_imported_families_are_looked_at(monkeypatch) -> None:
    import sys

    llama, *others = (entry[0] for entry in cpu_fused.FAMILY_MODULES)
    for name in others:
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert [f.classes["rms_norm"].__name__ for f in cpu_fused.families()] == ["LlamaRMSNorm"]
    assert llama in sys.modules and not any(name in sys.modules for name in others)


def test_a_forward_without_the_rotary_global_is_not_fused() -> None:
    class NoRotary(nn.Module):
        def forward(self, x):
            return x

    assert cpu_fused.fused_class(NoRotary, "attention") is None
