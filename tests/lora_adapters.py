"""PEFT LoRA adapters for tests, made by PEFT itself, and PEFT's own greedy tokens as the reference."""

from __future__ import annotations

from pathlib import Path

import torch

from keepwarm_runtime import LLM
from tests.integration.engine.reference import transformers_greedy


def lora_engine(
    model_dir: Path, max_loras: int, max_lora_rank: int = 64, socket_dir: Path | None = None
) -> LLM:
    """The LoRA tests' engine: fp32, small blocks and batches so steps mix prefill and decode; with
    ``socket_dir``, the base and the adapters come through that node cache."""
    return LLM(
        model_dir,
        dtype="float32",
        block_size=4,
        num_kv_blocks=256,
        max_num_batched_tokens=64,
        enable_lora=True,
        max_loras=max_loras,
        max_lora_rank=max_lora_rank,
        cache_socket_dir=str(socket_dir) if socket_dir else None,
    )


def make_adapter(model_dir: Path, out: Path, seed: int, **config) -> Path:
    """A PEFT adapter saved by PEFT, its lora_B random so it changes the output."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(lora_dropout=0.0, **config))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.3)
    model.save_pretrained(out)
    return out


def peft_greedy(
    model_dir: Path, adapter: Path | None, prompts: list[list[int]], new_tokens: int = 6
) -> list[list[int]]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    return transformers_greedy(model, prompts, new_tokens)


def served_greedy(client, model: str, prompt: list[int], new_tokens: int) -> list[int]:
    """The greedy token ids a real `keepwarm serve` gives ``model`` (the base or an adapter) through the
    openai client: exactly ``new_tokens`` of them (min_tokens), as ids (return_tokens_as_token_ids)."""
    out = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=new_tokens,
        temperature=0,
        logprobs=0,
        extra_body={"min_tokens": new_tokens, "return_tokens_as_token_ids": True},
    )
    return [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens]
