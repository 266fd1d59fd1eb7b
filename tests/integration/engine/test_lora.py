"""LoRA adapters: greedy fp32 tokens equal PEFT's PeftModel.generate(), alone and mixed in one batch.

Adapters are made by PEFT itself (get_peft_model + save_pretrained) on tiny generated bases, with
lora_B drawn at random (PEFT initialises it to zero, which would make every adapter the base). The
engine batches requests for several adapters and the base together, with fewer slots than adapters
(so adapters queue, are evicted and reloaded), and small blocks (so the prefix cache is exercised).
Bad adapters are refused by name at load, and the engine keeps serving what it served.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from keepwarm_runtime import LLM, SamplingParams
from keepwarm_runtime.engine.llm import LoRARequest
from keepwarm_runtime.engine.lora import LoraInUse, LoraLoadError
from tests.lora_adapters import lora_engine, make_adapter, peft_greedy

NEW_TOKENS = 6
PARAMS = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
ADAPTERS = {  # name -> LoraConfig arguments
    "attn": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    "mlp": {"r": 8, "lora_alpha": 16, "target_modules": ["gate_proj", "up_proj", "down_proj"]},
    "kv": {"r": 2, "lora_alpha": 32, "target_modules": ["k_proj", "v_proj", "o_proj"]},
    "all": {
        "r": 16,
        "lora_alpha": 8,
        "use_rslora": True,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    },
}


def prompts_for(vocab: int, count: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (5 + 4 * i,), generator=g).tolist() for i in range(count)]


@pytest.fixture(scope="module")
def lora_setup(make_tiny, tmp_path_factory: pytest.TempPathFactory):
    """Per architecture: the base, its adapters (name -> dir), prompts and PEFT's tokens per adapter."""
    made: dict[str, tuple] = {}

    def setup(arch: str, names: tuple[str, ...]):
        if arch not in made:
            model_dir = make_tiny(arch)
            root = tmp_path_factory.mktemp(f"lora-{arch}")
            adapters = {
                n: make_adapter(model_dir, root / n, seed=i, **ADAPTERS[n]) for i, n in enumerate(names)
            }
            prompts = prompts_for(2048, 3, seed=len(arch))
            expected = {
                n: peft_greedy(model_dir, adapters.get(n), prompts, NEW_TOKENS) for n in [None, *names]
            }
            made[arch] = model_dir, adapters, prompts, expected
        return made[arch]

    return setup


def engine(model_dir: Path, max_loras: int, max_lora_rank: int = 64) -> LLM:
    return lora_engine(model_dir, max_loras, max_lora_rank)


def requests(adapters: dict[str, Path]) -> dict[str | None, LoRARequest | None]:
    return {None: None} | {n: LoRARequest(n, i + 1, str(p)) for i, (n, p) in enumerate(adapters.items())}


@pytest.mark.parametrize(
    ("arch", "names"),
    [
        ("llama", ("attn", "mlp", "kv", "all")),
        ("qwen3", ("attn", "mlp", "kv", "all")),
        ("qwen3_moe", ("attn",)),
    ],
)
def test_adapters_alone_and_mixed_match_peft(lora_setup, arch: str, names: tuple[str, ...]) -> None:
    model_dir, adapters, prompts, expected = lora_setup(arch, names)
    for name in names:  # every adapter changes the output: a no-op update could not pass below
        assert expected[name] != expected[None], f"{arch}: adapter {name} does not change the tokens"
    lora = requests(adapters)
    llm = engine(model_dir, max_loras=len(names))
    for name in names:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, lora_request=lora[name])
        assert [o.outputs[0].token_ids for o in outs] == expected[name], f"{arch}: adapter {name} alone"

    # One batch: every prompt under every adapter and the base, interleaved.
    order = [(name, i) for i in range(len(prompts)) for name in [None, *names]]
    outs = llm.generate(
        [{"prompt_token_ids": prompts[i]} for _, i in order], PARAMS, lora_request=[lora[n] for n, _ in order]
    )
    got = {(n, i): o.outputs[0].token_ids for (n, i), o in zip(order, outs, strict=True)}
    wrong = [(n, i) for n, i in order if got[n, i] != expected[n][i]]
    assert not wrong, f"{arch}: mixed batch differs from PEFT for (adapter, prompt) {wrong}"


def test_fewer_slots_than_adapters_queue_evict_and_reload(lora_setup) -> None:
    model_dir, adapters, prompts, expected = lora_setup("llama", ("attn", "mlp", "kv", "all"))
    lora = requests(adapters)
    llm = engine(model_dir, max_loras=2)
    slots = llm.engine.lora
    for name in ("attn", "mlp", "all"):  # the third evicts the least recently used: attn
        llm.generate({"prompt_token_ids": prompts[0]}, PARAMS, lora_request=lora[name])
    assert list(slots.resident) == ["mlp", "all"]
    out = llm.generate({"prompt_token_ids": prompts[1]}, PARAMS, lora_request=lora["attn"])  # reloaded
    assert out[0].outputs[0].token_ids == expected["attn"][1]
    assert list(slots.resident) == ["all", "attn"]

    # Four adapters and the base at once on two slots: two adapters wait, nothing fails.
    order = [(n, i) for i in range(len(prompts)) for n in (None, "attn", "mlp", "kv", "all")]
    outs = llm.generate(
        [{"prompt_token_ids": prompts[i]} for _, i in order], PARAMS, lora_request=[lora[n] for n, _ in order]
    )
    assert all(o.error is None for o in outs)
    wrong = [
        (n, i) for (n, i), o in zip(order, outs, strict=True) if o.outputs[0].token_ids != expected[n][i]
    ]
    assert not wrong, f"queued and reloaded adapters differ from PEFT for {wrong}"
    assert not slots.pins, "finished sequences still pin their slots"


def test_prefix_cache_is_per_adapter(lora_setup) -> None:
    model_dir, adapters, prompts, expected = lora_setup("llama", ("attn", "mlp", "kv", "all"))
    lora = requests(adapters)
    llm = engine(model_dir, max_loras=2)
    prompt = {"prompt_token_ids": prompts[2]}  # 13 tokens: three full 4-token blocks
    base = llm.generate(prompt, PARAMS)[0]
    first = llm.generate(prompt, PARAMS, lora_request=lora["attn"])[0]
    again = llm.generate(prompt, PARAMS, lora_request=lora["attn"])[0]
    assert first.num_cached_tokens == 0, "KV computed by the base served a request for an adapter"
    assert again.num_cached_tokens > 0, "the adapter's own prefix was not cached"
    assert base.outputs[0].token_ids == expected[None][2]
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == expected["attn"][2]


def _corrupt(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    edit(dst)
    return dst


def _edit_config(**changes):
    def edit(directory: Path) -> None:
        path = directory / "adapter_config.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | changes))

    return edit


def _edit_tensors(rename=lambda k: k, reshape=None):
    from safetensors.torch import load_file, save_file

    def edit(directory: Path) -> None:
        path = directory / "adapter_model.safetensors"
        tensors = {rename(k): v for k, v in load_file(path).items()}
        if reshape is not None:
            key = next(k for k in tensors if "lora_A" in k)
            tensors[key] = torch.zeros(tensors[key].shape[0], tensors[key].shape[1] + 8)
        save_file(tensors, path)

    return edit


def _poison(value: float):
    """One lora_B weight set to ``value`` (NaN or an infinity)."""
    from safetensors.torch import load_file, save_file

    def edit(directory: Path) -> None:
        path = directory / "adapter_model.safetensors"
        tensors = load_file(path)
        key = sorted(k for k in tensors if "lora_B" in k)[-1]
        tensors[key][-1, -1] = value
        save_file(tensors, path)

    return edit


def _truncate(directory: Path) -> None:
    path = directory / "adapter_model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_bad_adapters_refused_by_name_and_nothing_else_affected(lora_setup, tmp_path: Path) -> None:
    model_dir, adapters, prompts, expected = lora_setup("llama", ("attn", "mlp", "kv", "all"))
    good = adapters["attn"]
    cases = {
        "truncated": (_corrupt(good, tmp_path / "t", _truncate), "not a readable safetensors"),
        "rank": (adapters["all"], "rank 16 is above this engine's max_lora_rank 8"),
        "missing": (
            _corrupt(good, tmp_path / "m", _edit_tensors(lambda k: k.replace("layers.0.", "layers.9."))),
            "has no module model.layers.9.",
        ),
        "other-base": (_corrupt(good, tmp_path / "s", _edit_tensors(reshape=True)), "another base"),
        "embed": (
            _corrupt(good, tmp_path / "e", _edit_config(target_modules=["embed_tokens"])),
            "embed_tokens",
        ),
        "dora": (_corrupt(good, tmp_path / "d", _edit_config(use_dora=True)), "DoRA"),
        "saved": (
            _corrupt(good, tmp_path / "k", _edit_config(modules_to_save=["lm_head"])),
            "modules_to_save",
        ),
        "experts": (
            _corrupt(good, tmp_path / "x", _edit_config(target_parameters=["mlp.experts.gate_up_proj"])),
            "target_parameters",
        ),
        "no-dir": (tmp_path / "absent", "is not a directory"),
        "nan": (_corrupt(good, tmp_path / "n", _poison(float("nan"))), "NaN or infinite"),
        "inf": (_corrupt(good, tmp_path / "i", _poison(float("-inf"))), "NaN or infinite"),
        "moe-experts": (
            _corrupt(
                good,
                tmp_path / "y",
                _edit_tensors(lambda k: k.replace("self_attn.q_proj", "mlp.experts.0.up_proj")),
            ),
            "inside MoE experts",
        ),
    }
    llm = engine(model_dir, max_loras=2, max_lora_rank=8)
    llm.engine.add_lora("good", str(good))
    for name, (path, why) in cases.items():
        with pytest.raises(LoraLoadError) as err:
            llm.engine.add_lora(name, str(path))
        assert repr(name) in str(err.value) and why in str(err.value), str(err.value)
    assert llm.engine.lora_names() == ["good"]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts[:2]],
        PARAMS,
        lora_request=[LoRARequest("good", 1, ""), None],
    )
    assert [o.outputs[0].token_ids for o in outs] == [expected["attn"][0], expected[None][1]]


def test_remove_refuses_while_in_use_and_unknown_names(lora_setup) -> None:
    model_dir, adapters, prompts, _ = lora_setup("llama", ("attn", "mlp", "kv", "all"))
    llm = engine(model_dir, max_loras=1)
    llm.engine.add_lora("attn", str(adapters["attn"]))
    llm.engine.add_request("r", prompts[0], PARAMS, lora_name="attn")
    with pytest.raises(LoraInUse, match="'attn' is in use"):
        llm.engine.remove_lora("attn")
    with pytest.raises(ValueError, match="'nope' is not loaded"):
        llm.engine.add_request("x", prompts[0], PARAMS, lora_name="nope")
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    llm.engine.remove_lora("attn")
    assert llm.engine.lora_names() == [] and not llm.engine.lora.resident
    with pytest.raises(KeyError):
        llm.engine.remove_lora("attn")
