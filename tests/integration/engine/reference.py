"""transformers' own greedy generate(), one prompt at a time: the reference keepwarm's output must equal."""

from __future__ import annotations

import torch


def transformers_greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Exactly `new_tokens` greedy tokens per prompt (min_new_tokens masks EOS, like keepwarm's min_tokens);
    each prompt runs alone, so no padding changes the numbers."""
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=model.device)
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(gen[0, ids.shape[1] :].tolist())
    return outs
