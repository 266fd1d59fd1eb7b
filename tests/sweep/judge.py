"""Judge one transformers model type: keepwarm's greedy tokens against transformers' generate().

Each type ends as one verdict:
- identical: every condition below gave transformers' tokens exactly;
- refused: keepwarm raised a named refusal while loading (the reason is its message);
- not_judged: transformers itself could not build, save, reload or generate with the tiny config;
- different: some condition gave other tokens (the one result the engine promises never to give);
- error: keepwarm failed in an unnamed way (a crash is not a refusal).

Conditions (block size 4; the shrunk window is 8, see shrink.py):
- short: prompts of 3 and 6 tokens, one pass each;
- long: prompts of 20, 29 and 40 tokens, past the window;
- chunked: the long prompts with a 5-token budget, so chunk edges fall inside windows and blocks;
- prefix: two prompts sharing a 24-token prefix, the second after the first (a prefix-cache hit);
- preemption: the long prompts at once with too few KV blocks, so sequences are preempted and recomputed;
- batch16: 16 prompts of 3..40 tokens in one batch.
A condition that did not happen (no cache hit, no preemption) is reported as an error, not a pass.
"""

from __future__ import annotations

import shutil
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

NEW_TOKENS = 8
BLOCK_SIZE = 4
VOCAB_LOW, VOCAB_HIGH = 10, 2000  # prompt token ids: clear of special tokens, inside the 2048 vocab
MAX_PARAMS = 30_000_000  # a shrink that leaves more is not tiny: not judged


@dataclass(frozen=True)
class Condition:
    name: str
    prompts: tuple[tuple[int, ...], ...]
    engine: dict[str, Any]  # EngineConfig fields
    staggered: bool = False  # submit one prompt after another (prefix hits) instead of all at once
    expect: str | None = None  # "cache_hit" | "preemption": what must have happened


@dataclass
class Verdict:
    model_type: str
    verdict: str  # identical | refused | not_judged | different | error
    reason: str = ""
    conditions: dict[str, str] = field(default_factory=dict)  # condition -> "identical" or what differed
    features: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _prompt(length: int, seed: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(VOCAB_LOW, VOCAB_HIGH, (length,), generator=g).tolist())


def conditions() -> list[Condition]:
    long = tuple(_prompt(n, 100 + n) for n in (20, 29, 40))
    prefix = _prompt(24, 7)
    roomy = {"num_kv_blocks": 256, "max_num_batched_tokens": 256}
    # Each long prompt needs up to 12 blocks at full length: 3 at once cannot fit in 20.
    return [
        Condition("short", tuple(_prompt(n, n) for n in (3, 6)), roomy),
        Condition("long", long, roomy),
        Condition("chunked", long, {"num_kv_blocks": 256, "max_num_batched_tokens": 5}),
        Condition(
            "prefix",
            (prefix + _prompt(5, 8), prefix + _prompt(9, 9)),
            roomy,
            staggered=True,
            expect="cache_hit",
        ),
        Condition(
            "preemption", long, {"num_kv_blocks": 20, "max_num_batched_tokens": 64}, expect="preemption"
        ),
        Condition(
            "batch16",
            tuple(_prompt(3 + (7 * i) % 38, 200 + i) for i in range(16)),
            {"num_kv_blocks": 512, "max_num_batched_tokens": 64},
        ),
    ]


def features(config) -> list[str]:
    """The attention features a config exercises, for the report and the always-on subset."""
    text = config.get_text_config()
    found = []
    heads, kv = getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None)
    if isinstance(heads, int) and isinstance(kv, int) and kv < heads:
        found.append("gqa")
    if getattr(text, "sliding_window", None):
        found.append("window")
    if getattr(text, "attn_logit_softcapping", None) or getattr(text, "final_logit_softcapping", None):
        found.append("softcap")
    if "gpt_oss" in text.model_type or getattr(text, "use_sinks", False):
        found.append("sinks")
    if getattr(text, "kv_lora_rank", None):
        found.append("mla")
    experts = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
    if any(getattr(text, k, None) for k in experts):
        found.append("moe")
    return found


def build_checkpoint(model_type: str, out: Path, tokenizer_dir: Path):
    """Save a tiny random model of `model_type` with the shared tokenizer; return its config."""
    from transformers import AutoModelForCausalLM

    from tests.sweep.shrink import tiny_config

    config = tiny_config(model_type)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in meta.parameters())
    if params > MAX_PARAMS:
        raise ValueError(f"the shrunk model still has {params / 1e6:.0f}M parameters")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    for path in tokenizer_dir.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens")) or path.suffix == ".jinja":
            shutil.copy(path, out / path.name)
    return config


def reference(model_dir: Path, prompts: list[tuple[int, ...]]) -> dict[tuple[int, ...], list[int]]:
    """transformers' greedy tokens, the model reloaded from disk like keepwarm loads it."""
    from transformers import AutoModelForCausalLM

    from tests.integration.engine.reference import transformers_greedy

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = transformers_greedy(model, [list(p) for p in prompts], NEW_TOKENS)
    return dict(zip(prompts, outs, strict=True))


def run_condition(llm, cond: Condition, expected: dict) -> str:
    """ "identical", or what differed; raises when the condition did not happen."""
    from keepwarm_runtime import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    requests = [{"prompt_token_ids": list(p)} for p in cond.prompts]
    if cond.staggered:
        outputs = [llm.generate(r, params)[0] for r in requests]
    else:
        outputs = llm.generate(requests, params)
    for i, (prompt, out) in enumerate(zip(cond.prompts, outputs, strict=True)):
        got, want = out.outputs[0].token_ids, expected[prompt]
        if got != want:
            return f"different: prompt {i} ({len(prompt)} tokens): keepwarm {got} != transformers {want}"
    if cond.expect == "cache_hit" and not outputs[-1].num_cached_tokens:
        raise RuntimeError("the shared prefix was not served from the prefix cache")
    if cond.expect == "preemption" and not llm.engine.scheduler.num_preemptions:
        raise RuntimeError("no sequence was preempted")
    return "identical"


def judge(model_type: str, work: Path, tokenizer_dir: Path, progress=lambda phase: None) -> Verdict:
    """`progress(phase)` is told each phase ("transformers", "keepwarm <condition>") as it starts."""
    from keepwarm_runtime import LLM
    from keepwarm_runtime.engine.attention.fuser import AttentionFusionError
    from keepwarm_runtime.engine.attention.select import BackendUnavailable
    from keepwarm_runtime.engine.loader import ModelLoadError

    refusals = (AttentionFusionError, ModelLoadError, BackendUnavailable, NotImplementedError)
    start = time.monotonic()
    verdict = Verdict(model_type, "not_judged")
    model_dir = work / model_type
    progress("transformers")
    try:
        config = build_checkpoint(model_type, model_dir, tokenizer_dir)
        verdict.features = features(config)
    except Exception as exc:
        verdict.reason = f"transformers: {_short(exc)}"
        verdict.seconds = time.monotonic() - start
        return verdict
    conds = conditions()
    # A refusal needs no reference: keepwarm loads first (transformers may not even generate).
    progress(f"keepwarm {conds[0].name}")
    try:
        first = LLM(model_dir, dtype="float32", block_size=BLOCK_SIZE, **conds[0].engine)
    except refusals as exc:  # refused up front, while loading
        verdict.verdict, verdict.reason = "refused", f"{type(exc).__name__}: {exc}"
        verdict.seconds = time.monotonic() - start
        return verdict
    except Exception as exc:
        first, load_error = None, exc  # keepwarm's fault only if transformers itself can generate
    else:
        load_error = None
    progress("transformers")
    try:
        expected = reference(model_dir, list(dict.fromkeys(p for c in conds for p in c.prompts)))
    except Exception as exc:
        verdict.reason = f"transformers: {_short(exc)}"
        verdict.seconds = time.monotonic() - start
        return verdict
    if load_error is not None:
        verdict.verdict, verdict.reason = "error", f"loading: {_short(load_error)}"
        verdict.seconds = time.monotonic() - start
        return verdict
    for cond in conds:
        progress(f"keepwarm {cond.name}")
        try:
            llm = (
                first
                if cond is conds[0]
                else LLM(model_dir, dtype="float32", block_size=BLOCK_SIZE, **cond.engine)
            )
        except Exception as exc:  # loaded once already: failing now is no refusal
            verdict.verdict, verdict.reason = "error", f"loading for {cond.name}: {_short(exc)}"
            break
        try:
            verdict.conditions[cond.name] = run_condition(llm, cond, expected)
        except Exception as exc:  # a refusal after loading is no refusal: it fails a running request
            verdict.verdict, verdict.reason = "error", f"{cond.name}: {_short(exc)}"
            verdict.conditions[cond.name] = "error: " + traceback.format_exc(limit=-3)
            break
    else:
        different = [n for n, r in verdict.conditions.items() if r != "identical"]
        verdict.verdict = "different" if different else "identical"
        verdict.reason = f"differs under {', '.join(different)}" if different else ""
    verdict.seconds = time.monotonic() - start
    return verdict


def _short(exc: BaseException, limit: int = 300) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."
