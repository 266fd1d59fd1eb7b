"""The tensor-parallel split as pure functions: what each rank holds, that the ranks' slices make up
the whole tensor, the plan read from transformers' declarations, and the refusals that name a layer."""

from __future__ import annotations

import pytest
import torch

from keepwarm_runtime.weights import tensor_parallel as tp
from keepwarm_runtime.weights import tensor_parallel_plan as plans
from keepwarm_runtime.weights.kernel_layout import conversion_id
from keepwarm_runtime.weights.layouts import CONVERSION_ID
from keepwarm_runtime.weights.tensor_parallel import Sharding, ShardingError, Split, TensorShard


def _meta(arch: str, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    from keepwarm_runtime.modelgen import architectures

    kwargs = getattr(architectures, arch)(128, 2, 256) | overrides
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _assemble(whole: torch.Tensor, split: Split, size: int, regions=None) -> list[torch.Tensor]:
    """Each rank's shard of ``whole``, written region by region as the arena writes it."""
    shards = []
    for rank in range(size):
        shard = TensorShard(split, tuple(whole.shape), Sharding(rank, size))
        held = torch.full(shard.shape, float("nan"))
        for starts, block in regions or [((0,) * whole.dim(), whole)]:
            for source, target in shard.copies(starts, tuple(block.shape)):
                held[target] = 0 if source is None else block[source]
        shards.append(held)
    return shards


def _rejoin(shards: list[torch.Tensor], whole_shape, split: Split) -> torch.Tensor:
    """The whole tensor back from the ranks' shards, by ``chunks``."""
    out = torch.full(whole_shape, float("nan"))
    d = split.dim
    for rank, held in enumerate(shards):
        for start, stop, local in tp.chunks(whole_shape[d], split, Sharding(rank, len(shards))):
            index = [slice(None)] * len(whole_shape)
            local_index = list(index)
            index[d], local_index[d] = slice(start, stop), slice(local, local + stop - start)
            out[tuple(index)] = held[tuple(local_index)]
    return out


@pytest.mark.parametrize(
    ("split", "shape"),
    [
        (Split(0), (8, 6)),
        (Split(1), (6, 8)),
        (Split(1, parts=2), (3, 8, 5)),  # [gate; up] halves split apart
        (Split(2, granule=2), (3, 5, 8)),  # interleaved pairs stay whole
        (Split(0, uneven=True), (11, 4)),  # a vocabulary that does not divide
    ],
)
@pytest.mark.parametrize("size", [2, 4])
def test_the_ranks_slices_make_up_the_whole_tensor(split: Split, shape, size: int) -> None:
    whole = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
    if not split.uneven:
        tp.check_split("t", shape, split, Sharding(0, size))
    shards = _assemble(whole, split, size)
    assert not any(torch.isnan(s).any() for s in shards)
    assert torch.equal(_rejoin(shards, shape, split), whole)
    assert sum(s.numel() for s in shards) == whole.numel()


def test_merged_expert_rows_land_where_the_whole_tensor_puts_them() -> None:
    # gate and up of each expert are written as rows [0, I) and [I, 2I) of [E, 2I, H]
    E, I, H = 4, 6, 3  # noqa: E741
    whole = torch.randn(E, 2 * I, H)
    regions = [
        ((e, s * I, 0), whole[e, s * I : (s + 1) * I].unsqueeze(0)) for e in range(E) for s in range(2)
    ]
    for split in (Split(1, parts=2), Split(0)):  # split experts, expert parallel
        shards = _assemble(whole, split, 2, regions)
        assert torch.equal(_rejoin(shards, whole.shape, split), whole)
        if split.parts == 2:  # each rank: its rows of the gate, then its rows of the up half
            assert torch.equal(shards[1], torch.cat([whole[:, 3:6], whole[:, 9:12]], dim=1))


def test_a_bias_summed_by_an_all_reduce_is_held_by_rank_0_alone() -> None:
    bias = torch.randn(5)
    zero, one = _assemble(bias, Split(first_rank_only=True), 2)
    assert torch.equal(zero, bias) and torch.equal(one, torch.zeros(5))


def test_splits_that_do_not_divide_name_the_tensor() -> None:
    with pytest.raises(ShardingError, match=r"^q\.weight: dimension 0 \(6\) does not divide over 4"):
        tp.check_split("q.weight", (6, 8), Split(0), Sharding(0, 4))
    with pytest.raises(ShardingError, match=r"in whole units of 128"):
        tp.check_split("w", (256, 128), tp.scaled(Split(1), 2), Sharding(0, 2))
    tp.check_split("w", (256, 512), tp.scaled(Split(1), 2), Sharding(0, 2))
    # along the experts (a leading axis) FP8 blocks need nothing
    assert tp.scaled(Split(0), 3) == Split(0)
    assert tp.in_blocks(tp.scaled(Split(2), 3), 3) == Split(2)


def test_sharding_is_named_in_the_key_conversion() -> None:
    assert conversion_id("model") == CONVERSION_ID
    assert conversion_id("model", Sharding(1, 2)) == f"{CONVERSION_ID}+tp-v1"
    assert conversion_id("model", Sharding(0, 2, expert=True)) == f"{CONVERSION_ID}+tp-v1-ep"
    with pytest.raises(ValueError, match="rank 2 is not in a group of 2"):
        Sharding(2, 2)


def test_llama_splits_as_transformers_declares() -> None:
    plan = plans.shard_plan(_meta("llama"), Sharding(0, 2))
    layer = "model.layers.0"
    assert plan.splits[f"{layer}.self_attn.q_proj.weight"] == Split(0)
    assert plan.splits[f"{layer}.self_attn.o_proj.weight"] == Split(1)
    assert plan.splits[f"{layer}.mlp.down_proj.weight"] == Split(1)
    assert plan.splits["model.embed_tokens.weight"] == Split(0, uneven=True)
    assert plan.splits["lm_head.weight"] == Split(0, uneven=True)
    assert plan.split_of(f"{layer}.input_layernorm.weight").replicated
    assert plan.styles[f"{layer}.self_attn.o_proj"] == plans.ROWWISE
    assert plan.styles["lm_head"] == plans.VOCAB_HEAD


def test_gpt_oss_attention_follows_keepwarms_documented_plan() -> None:
    plan = plans.shard_plan(_meta("gpt_oss"), Sharding(0, 2))
    attn = "model.layers.0.self_attn"
    assert plan.splits[f"{attn}.sinks"] == Split(0)  # one sink per query head
    assert plan.splits[f"{attn}.o_proj.bias"] == Split(first_rank_only=True)
    experts = "model.layers.0.mlp.experts"  # [E, H, 2I] interleaved: even chunks of the last axis
    assert plan.splits[f"{experts}.gate_up_proj"] == Split(2, granule=2)
    assert plan.splits[f"{experts}.down_proj_bias"] == Split(first_rank_only=True)


def test_experts_are_partitioned_or_split() -> None:
    model = _meta("qwen3_moe")
    experts = "model.layers.0.mlp.experts"
    split = plans.shard_plan(model, Sharding(0, 2))
    parallel = plans.shard_plan(model, Sharding(0, 2, expert=True))
    assert split.splits[f"{experts}.gate_up_proj"] == Split(1, parts=2)
    assert split.splits[f"{experts}.down_proj"] == Split(2)
    assert parallel.splits[f"{experts}.gate_up_proj"] == Split(0)
    assert split.split_of("model.layers.0.mlp.gate.weight").replicated  # the router stays whole
    with pytest.raises(
        ShardingError, match=r"experts\.gate_up_proj: dimension 0 \(4\) does not divide over 8"
    ):
        plans.shard_plan(
            _meta("qwen3_moe", num_attention_heads=8, num_key_value_heads=8), Sharding(0, 8, True)
        )


def test_deepseek_latent_projection_stays_whole() -> None:
    plan = plans.shard_plan(_meta("deepseek_v3"), Sharding(0, 2))
    attn = "model.layers.0.self_attn"
    assert plan.split_of(f"{attn}.kv_a_proj_with_mqa.weight").replicated
    assert plan.splits[f"{attn}.kv_b_proj.weight"] == Split(0)
    assert plan.splits["model.layers.1.mlp.shared_experts.down_proj.weight"] == Split(1)


def test_refusals_name_the_layer() -> None:
    with pytest.raises(
        ShardingError, match=r"self_attn: 2 key/value heads \(num_key_value_heads\) do not divide"
    ):
        plans.shard_plan(_meta("llama"), Sharding(0, 4))
    with pytest.raises(ShardingError, match=r"^opt: no tensor-parallel plan"):
        plans.shard_plan(_meta("opt"), Sharding(0, 2))


def test_a_transformers_style_keepwarm_does_not_implement_is_refused(monkeypatch) -> None:
    model = _meta("llama")
    plan = dict(model.config.base_model_tp_plan) | {"layers.*.mlp.up_proj": "local_colwise"}
    monkeypatch.setattr(type(model.config), "base_model_tp_plan", plan)
    with pytest.raises(ShardingError, match=r"model\.layers\.0\.mlp\.up_proj: .* style 'local_colwise'"):
        plans.shard_plan(model, Sharding(0, 2))
