"""engine/lora on a toy module: the per-token update is each token's own adapter's (or none), slots are
reused least-recently-used first and never taken from a pinned adapter; `--lora-modules` parsing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from keepwarm_runtime.engine.lora import LoraLoadError, LoraSlots
from keepwarm_runtime.engine.lora.slots import use_step
from keepwarm_runtime.server.base.lora_modules import LoraModule, parse_lora_module

IN, OUT = 6, 5


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(IN, OUT, bias=False)


def adapter(root: Path, name: str, rank: int, alpha: float, seed: int, rslora: bool = False):
    """A PEFT-format adapter on Toy.q_proj; returns its directory and its dense update matrix."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(rank, IN, generator=g), torch.randn(OUT, rank, generator=g)
    directory = root / name
    directory.mkdir()
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "use_rslora": rslora,
        "target_modules": ["q_proj"],
    }
    (directory / "adapter_config.json").write_text(json.dumps(config))
    save_file(
        {"base_model.model.q_proj.lora_A.weight": a, "base_model.model.q_proj.lora_B.weight": b},
        directory / "adapter_model.safetensors",
    )
    scaling = alpha / rank**0.5 if rslora else alpha / rank
    return directory, (b @ a) * scaling


def test_each_token_gets_its_own_adapter_or_none(tmp_path: Path) -> None:
    model = Toy()
    slots = LoraSlots(model, max_loras=2, max_rank=8)
    one, delta_one = adapter(tmp_path, "one", rank=2, alpha=4, seed=1)
    two, delta_two = adapter(tmp_path, "two", rank=8, alpha=4, seed=2, rslora=True)
    slots.add("one", one)
    slots.add("two", two)
    assert slots.acquire("one") and slots.acquire("two")
    x = torch.randn(1, 4, IN)
    base = model.q_proj(x)[0]
    names = ["two", None, "one", "two"]
    with use_step(slots.step([slots.slot(n) for n in names])), torch.no_grad():
        got = model.q_proj(x)[0]
    deltas = {None: torch.zeros(OUT, IN), "one": delta_one, "two": delta_two}
    want = torch.stack([base[i] + x[0, i] @ deltas[n].T for i, n in enumerate(names)])
    torch.testing.assert_close(got, want)
    assert torch.equal(got[1], base[1])  # a base token gets no update at all


def test_slots_are_reused_lru_and_pinned_ones_are_never_taken(tmp_path: Path) -> None:
    slots = LoraSlots(Toy(), max_loras=2, max_rank=4)
    for i, name in enumerate(("a", "b", "c")):
        slots.add(name, adapter(tmp_path, name, rank=2, alpha=2, seed=i)[0])
    assert slots.acquire("a") and slots.acquire("b")
    assert not slots.acquire("c"), "took a slot from an adapter in use"
    slots.release("a")
    assert slots.acquire("c") and list(slots.resident) == ["b", "c"]  # a, unpinned, was evicted
    slots.release("b")
    assert slots.acquire("a") and list(slots.resident) == ["c", "a"]


def test_a_refused_adapter_leaves_nothing_behind(tmp_path: Path) -> None:
    slots = LoraSlots(Toy(), max_loras=1, max_rank=4)
    big, _ = adapter(tmp_path, "big", rank=8, alpha=8, seed=0)
    with pytest.raises(LoraLoadError, match="'big': rank 8 is above this engine's max_lora_rank 4"):
        slots.add("big", big)
    assert not slots.adapters and not slots.ids


def test_lora_modules_values() -> None:
    assert parse_lora_module("sql=/a/b") == LoraModule("sql", "/a/b")
    assert parse_lora_module('{"name": "x", "path": "/p", "base_model_name": "m"}') == LoraModule(
        "x", "/p", "m"
    )
    for bad in ("sql", "=/p", '{"name": "x"}', '{"name": "x", "path": "/p", "rank": 8}', "{oops"):
        with pytest.raises(ValueError):
            parse_lora_module(bad)


def test_scheduler_queues_adapters_without_a_slot_fcfs_and_lets_the_base_through(tmp_path: Path) -> None:
    from keepwarm_runtime.engine.block_manager import BlockManager
    from keepwarm_runtime.engine.sampling_params import SamplingParams
    from keepwarm_runtime.engine.scheduler import Scheduler
    from keepwarm_runtime.engine.sequence import Sequence

    slots = LoraSlots(Toy(), max_loras=1, max_rank=4)
    for i, name in enumerate(("a", "b")):
        slots.add(name, adapter(tmp_path, name, rank=2, alpha=2, seed=i)[0])
    s = Scheduler(BlockManager(64, 4), 8, 64, slots)
    seqs = {}
    for rid, lora in (("a1", "a"), ("b1", "b"), ("base", None), ("a2", "a")):
        seqs[rid] = Sequence(
            rid, 0, [1, 2, 3], SamplingParams(), lora_name=lora, lora_id=slots.ids.get(lora, 0)
        )
        s.add(seqs[rid])
    assert [q.request_id for q in s.schedule().seqs] == ["a1", "base"]  # a2 waits behind b1, not past it
    s.finish(seqs["a1"])
    assert [q.request_id for q in s.schedule().seqs] == ["base", "b1"]
    assert list(slots.resident) == ["b"] and slots.pins == {"b": 1}
    s.finish(seqs["b1"])
    assert [q.request_id for q in s.schedule().seqs] == ["base", "a2"]
    assert seqs["a2"].hash_salt != seqs["base"].hash_salt != seqs["b1"].hash_salt
