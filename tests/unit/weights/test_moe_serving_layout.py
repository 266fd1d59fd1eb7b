"""The serving-layout plan: which checkpoint tensors the weight cache merges, and where each one lands."""

from __future__ import annotations

import torch

from keepwarm_runtime.weights.serving_layout import MergeRule, Placement, plan, tensor_dtype, with_scales

RULES = with_scales(
    [
        MergeRule(
            ("mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"),
            "mlp.experts.gate_up_proj",
            True,
        ),
        MergeRule(("mlp.experts.*.down_proj.weight",), "mlp.experts.down_proj", False),
    ]
)


def _experts(
    layer: int, n: int, dtype=torch.bfloat16, inter: int = 6, hidden: int = 4, skip: int | None = None
):
    out = []
    for e in range(n):
        if e == skip:
            continue
        for proj, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
            out.append((f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight", shape, dtype))
    return out


def test_complete_expert_groups_merge_like_transformers() -> None:
    records = [("model.embed_tokens.weight", (10, 4), torch.bfloat16), *_experts(0, 3)]
    p = plan(records, RULES)
    assert [(t.name, t.shape) for t in p.targets] == [
        ("model.layers.0.mlp.experts.gate_up_proj", (3, 12, 4)),
        ("model.layers.0.mlp.experts.down_proj", (3, 4, 6)),
    ]
    assert p.placements["model.layers.0.mlp.experts.2.up_proj.weight"] == Placement(
        "model.layers.0.mlp.experts.gate_up_proj", 2, (6, 12)
    )
    assert p.placements["model.layers.0.mlp.experts.1.gate_proj.weight"].rows == (0, 6)
    assert p.placements["model.layers.0.mlp.experts.0.down_proj.weight"] == Placement(
        "model.layers.0.mlp.experts.down_proj", 0, (0, 4)
    )
    assert not p.merged("model.embed_tokens.weight")


def test_fp8_scales_merge_beside_their_weights() -> None:
    records = _experts(1, 2, torch.float8_e4m3fn)
    records += [(n + "_scale_inv", (1, 1), torch.float32) for n, _, _ in list(records)]
    p = plan(records, RULES)
    names = {t.name: t for t in p.targets}
    assert names["model.layers.1.mlp.experts.gate_up_proj_scale_inv"].shape == (2, 2, 1)
    assert names["model.layers.1.mlp.experts.gate_up_proj"].stored == torch.float8_e4m3fn
    assert (
        tensor_dtype("x.gate_up_proj_scale_inv", torch.float32, torch.bfloat16, {torch.float32})
        == torch.float32
    )
    assert tensor_dtype("x.weight", torch.float32, torch.bfloat16, {torch.float32}) == torch.bfloat16
    assert (
        tensor_dtype("x.weight", torch.float8_e4m3fn, torch.bfloat16, {torch.float32}) == torch.float8_e4m3fn
    )


def test_irregular_groups_stay_as_stored() -> None:
    gap = _experts(0, 3, skip=1)  # expert 1 missing
    mixed = [*_experts(1, 2), ("model.layers.1.mlp.experts.2.gate_proj.weight", (7, 4), torch.bfloat16)]
    mixed += [
        ("model.layers.1.mlp.experts.2.up_proj.weight", (7, 4), torch.bfloat16),
        ("model.layers.1.mlp.experts.2.down_proj.weight", (4, 7), torch.bfloat16),
    ]
    p = plan(gap + mixed, RULES)
    assert not any(t.name.startswith("model.layers.0.") for t in p.targets)
    assert not any("gate_up" in t.name and t.name.startswith("model.layers.1.") for t in p.targets)
    assert not p.merged("model.layers.0.mlp.experts.0.gate_proj.weight")


def test_concurrent_model_builds_leave_the_default_dtype_alone(tmp_path) -> None:
    """from_config sets torch's process-wide default dtype to the model's for the build; a disk attach
    plans (meta_model) in the background while the engine builds its own model. Interleaved, the two
    builds would leave bfloat16 behind for every later torch.zeros; BUILD_LOCK keeps them apart."""
    import threading

    import torch

    from keepwarm_runtime.modelgen import make_model
    from keepwarm_runtime.weights.serving_layout import BUILD_LOCK, meta_model

    model_dir = make_model(tmp_path / "m", arch="llama", params="400K", dtype="bfloat16")
    before = torch.get_default_dtype()

    def engine_builds() -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(model_dir)
        for _ in range(15):
            with BUILD_LOCK, torch.device("meta"):
                AutoModelForCausalLM.from_config(config, dtype=torch.float16)

    thread = threading.Thread(target=engine_builds)
    thread.start()
    for _ in range(15):
        assert meta_model(model_dir) is not None
    thread.join()
    assert torch.get_default_dtype() == before
