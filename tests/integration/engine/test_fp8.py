"""FP8 checkpoints (e4m3 + 128x128 block scales) and online FP8 quantization, against transformers.

Stated tolerances (fp32 compute unless said):
- keepwarm FP8 vs transformers' own FP8 path (its CPU dequantizing fallback), same checkpoint: greedy
  tokens identical, top-20 logprobs within 1e-4 nats.
- online `quantization="fp8"` vs the FP8 checkpoint made from the same float weights: identical bytes
  (keepwarm's quantizer equals transformers'), so logprobs within 1e-5.
- FP8 vs the bf16 model it was made from (transformers' default init range 0.02): top-20 logprobs
  within 0.25 nats; e4m3 keeps 3 mantissa bits, measured relative logit error ~6%.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from keepwarm_runtime import LLM, SamplingParams
from keepwarm_runtime.engine.loader import ModelLoadError
from keepwarm_runtime.engine.quant.fp8_modules import Fp8Linear
from keepwarm_runtime.weights.fp8 import E4M3
from tests.integration.engine.fp8_pairs import bf16_and_fp8
from tests.integration.engine.reference import transformers_greedy
from tests.integration.engine.shapes import DEEPSEEK_WHOLE_BLOCKS, WHOLE_BLOCKS

NEW_TOKENS = 6
TOP = 20


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    made = {}
    for arch in ("llama", "qwen3_moe"):
        made[arch], made[f"{arch}-fp8"] = bf16_and_fp8(tmp_path_factory, arch, arch, **WHOLE_BLOCKS)
    return made


def _prompt() -> list[int]:
    return torch.randint(10, 2000, (37,), generator=torch.Generator().manual_seed(3)).tolist()


def _keepwarm(model_dir: Path, **kwargs) -> tuple[LLM, list[int], dict[int, float]]:
    llm = LLM(model_dir, dtype="float32", block_size=4, num_kv_blocks=128, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=TOP)
    out = llm.generate({"prompt_token_ids": _prompt()}, params)[0].outputs[0]
    return llm, out.token_ids, {t: lp.logprob for t, lp in out.logprobs[0].items()}


def _transformers_logprobs(model_dir: Path) -> tuple[object, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([_prompt()])).logits[0, -1]
    return model, torch.log_softmax(logits.float(), -1)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_fp8_checkpoint_matches_transformers_fp8_path(checkpoints, arch) -> None:
    llm, tokens, logprobs = _keepwarm(checkpoints[f"{arch}-fp8"])
    model = llm.engine.model
    linears = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert linears and all(
        m.weight.dtype == E4M3 and m.weight_scale_inv.dtype == torch.float32 for m in linears
    )
    assert model.lm_head.weight.dtype == torch.float32  # the head stays unquantized
    if arch == "qwen3_moe":
        experts = model.model.layers[0].mlp.experts
        assert experts.gate_up_proj.dtype == E4M3 and experts.gate_up_proj_scale_inv.shape == (4, 2, 1)
    reference, expected = _transformers_logprobs(checkpoints[f"{arch}-fp8"])
    assert tokens == transformers_greedy(reference, [_prompt()], NEW_TOKENS)[0]
    for token, lp in logprobs.items():
        assert abs(lp - float(expected[token])) < 1e-4, (token, lp, float(expected[token]))
    _, bf16 = _transformers_logprobs(checkpoints[arch])
    worst = max(abs(lp - float(bf16[token])) for token, lp in logprobs.items())
    assert worst < 0.25, f"FP8 logprobs drift {worst:.3f} nats from the bf16 model"


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_online_fp8_equals_the_fp8_checkpoint(checkpoints, arch) -> None:
    _, tokens, logprobs = _keepwarm(checkpoints[arch], quantization="fp8")
    _, ckpt_tokens, ckpt_logprobs = _keepwarm(checkpoints[f"{arch}-fp8"])
    assert tokens == ckpt_tokens
    assert logprobs.keys() == ckpt_logprobs.keys()
    assert all(abs(logprobs[t] - ckpt_logprobs[t]) < 1e-5 for t in logprobs)


def _with_quantization(src: Path, dst: Path, quantization_config: dict) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    ("quantization_config", "message"),
    [
        ({"quant_method": "awq", "bits": 4}, "quant_method 'awq' is not supported"),
        ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' is not supported"),
        ({"quant_method": "mxfp4"}, "quant_method 'mxfp4' is not supported"),
        ({"quant_method": "fp8", "weight_block_size": [64, 64]}, r"weight_block_size \[64, 64\]"),
        ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "static"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "per-tensor FP8 checkpoints are refused"),
    ],
)
def test_other_quantizations_are_refused_by_name(checkpoints, tmp_path, quantization_config, message) -> None:
    model_dir = _with_quantization(checkpoints["llama"], tmp_path / "m", quantization_config)
    with pytest.raises(ModelLoadError, match=message):
        LLM(model_dir, dtype="float32", num_kv_blocks=16)


def test_online_quantization_of_an_fp8_checkpoint_is_refused(checkpoints) -> None:
    with pytest.raises(ModelLoadError, match="already fp8-quantized"):
        LLM(checkpoints["llama-fp8"], dtype="float32", num_kv_blocks=16, quantization="fp8")
    with pytest.raises(ValueError, match="quantization 'int4' is not supported"):
        LLM(checkpoints["llama"], dtype="float32", num_kv_blocks=16, quantization="int4")


def test_deepseek_v3_fp8_with_partial_blocks_stays_close_to_bf16(tmp_path) -> None:
    """MLA projections narrower than a block and experts with 2I <= 128: edge blocks are partial, and gate
    and up each carry their own scale grid (1 + 1 rows where one fused grid would have 1). transformers'
    dequantizer needs whole blocks, so the reference here is the bf16 model itself."""
    from keepwarm_runtime.modelgen import make_model
    from keepwarm_runtime.modelgen.fp8 import quantize_checkpoint

    src = make_model(
        tmp_path / "bf16", arch="deepseek_v3", params="2M", dtype="bfloat16", vocab_size=2048, hidden_size=128
    )
    fp8 = tmp_path / "fp8"
    shutil.copytree(src, fp8)
    quantize_checkpoint(fp8)
    llm, _, logprobs = _keepwarm(fp8)
    experts = llm.engine.model.model.layers[1].mlp.experts
    assert experts.gate_up_proj.shape[1] <= 128 and experts.gate_up_proj_scale_inv.shape[1] == 2
    kv_a = llm.engine.model.model.layers[0].self_attn.kv_a_proj_with_mqa
    assert isinstance(kv_a, Fp8Linear) and kv_a.weight.shape[0] % 128 != 0
    _, bf16 = _transformers_logprobs(src)
    worst = max(abs(lp - float(bf16[token])) for token, lp in logprobs.items())
    assert worst < 0.25, f"FP8 logprobs drift {worst:.3f} nats from the bf16 model"


def test_deepseek_v3_fp8_in_whole_blocks_matches_transformers_fp8_path(tmp_path) -> None:
    """DeepSeek-V3 (latent attention, grouped sigmoid router, shared expert) with every quantized
    projection whole 128x128 blocks, so transformers' own FP8 path reads the same checkpoint: greedy
    tokens identical, top-20 logprobs within 1e-4 nats of it, and within 0.25 nats of bf16."""
    from keepwarm_runtime.modelgen import make_model
    from keepwarm_runtime.modelgen.fp8 import quantize_checkpoint

    src = make_model(
        tmp_path / "bf16",
        arch="deepseek_v3",
        params="2M",
        dtype="bfloat16",
        vocab_size=2048,
        **DEEPSEEK_WHOLE_BLOCKS,
    )
    fp8 = tmp_path / "fp8"
    shutil.copytree(src, fp8)
    quantize_checkpoint(fp8)
    llm, tokens, logprobs = _keepwarm(fp8)
    model = llm.engine.model
    kv_a = model.model.layers[0].self_attn.kv_a_proj_with_mqa
    assert isinstance(kv_a, Fp8Linear) and kv_a.weight.shape[0] % 128 == 0
    experts = model.model.layers[1].mlp.experts
    assert experts.gate_up_proj.dtype == E4M3 and experts.gate_up_proj_scale_inv.shape == (4, 2, 1)
    reference, expected = _transformers_logprobs(fp8)
    assert tokens == transformers_greedy(reference, [_prompt()], NEW_TOKENS)[0]
    worst_fp8 = max(abs(lp - float(expected[token])) for token, lp in logprobs.items())
    assert worst_fp8 < 1e-4, f"keepwarm FP8 drifts {worst_fp8:.2e} nats from transformers' FP8 path"
    _, bf16 = _transformers_logprobs(src)
    worst = max(abs(lp - float(bf16[token])) for token, lp in logprobs.items())
    assert worst < 0.25, f"FP8 logprobs drift {worst:.3f} nats from the bf16 model"


def test_fp8_gpt_oss_checkpoint_with_experts_stored_transposed(tmp_path) -> None:
    """gpt-oss stores fused experts `[E, H, 2I]` (gate/up interleaved), so its FP8 checkpoint's block
    grid runs over the stored axes, as online quantization's does: the checkpoint and the online
    quantization of the same bf16 weights hold the same bytes and generate the same tokens (logprobs
    within 1e-5), and stay within 0.25 nats of bf16. transformers' own FP8 path is no reference here:
    it leaves gpt-oss' expert scales unused ("UNEXPECTED") and reads e4m3 as if it were float."""
    from keepwarm_runtime.modelgen import make_model
    from keepwarm_runtime.modelgen.fp8 import quantize_checkpoint

    src = make_model(
        tmp_path / "bf16", arch="gpt_oss", params="2M", dtype="bfloat16", vocab_size=2048, **WHOLE_BLOCKS
    )
    fp8 = tmp_path / "fp8"
    shutil.copytree(src, fp8)
    quantize_checkpoint(fp8)
    llm, tokens, logprobs = _keepwarm(fp8)
    experts = llm.engine.model.model.layers[0].mlp.experts
    assert experts.is_transposed and experts.gate_up_proj.dtype == E4M3
    assert experts.gate_up_proj_scale_inv.shape == (4, 1, 4)  # [E, H/128, 2I/128]: the stored axes
    online, online_tokens, online_logprobs = _keepwarm(src, quantization="fp8")
    online_experts = online.engine.model.model.layers[0].mlp.experts
    assert torch.equal(online_experts.gate_up_proj.view(torch.uint8), experts.gate_up_proj.view(torch.uint8))
    assert tokens == online_tokens
    assert all(abs(logprobs[t] - online_logprobs[t]) < 1e-5 for t in logprobs)
    _, bf16 = _transformers_logprobs(src)
    worst = max(abs(lp - float(bf16[token])) for token, lp in logprobs.items())
    assert worst < 0.25, f"FP8 logprobs drift {worst:.3f} nats from the bf16 model"
