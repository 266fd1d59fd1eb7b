"""LoRA adapters: load time per rank, and mixed-adapter throughput vs the base alone and vs PEFT.

    flock /tmp/kw-bench.lock .venv/bin/python bench/lora.py [--params 10M] [--prompts 16]
        [--prompt-len 32] [--output-tokens 32] [--ranks 8,16,64] [--adapters 4] [--threads 2] [--rounds 3]
        [--model-dir DIR] [--load-only] [--json-out FILE]

Generates a random-weight Llama of about --params parameters (unless --model-dir is given) and PEFT
adapters on every projection (q/k/v/o/gate/up/down, random lora_B), saved by PEFT itself. Measures:

* ``load_from_disk_ms[rank]``: registering an adapter (read + check, engine/lora/adapter.py) and copying
  it into a slot, median of 9 (the file is in the page cache after the first);
* ``load_from_cache_ms[rank]``: the same with the adapter attached zero-copy from a real node cache
  daemon (`keepwarm cache serve --adapter`, host tier, started here) instead of read from disk;
* ``base_tok_s``: --prompts greedy requests on the base, all at once (continuous batching);
* ``mixed_tok_s``: the same requests spread round-robin over --adapters adapters of the middle rank,
  all at once in the same engine (one batch mixes them);
* ``peft_tok_s``: PEFT's way, per adapter in turn: ``set_adapter`` then ``generate()`` on that
  adapter's requests as one batch (equal prompt lengths: no padding);
* ``mixed_over_base`` and ``mixed_over_peft``: the ratios the issue's goals name (>= 0.7 and >= 3).

Each throughput case runs --rounds times, the order rotating each round, and its best pass counts.

``--load-only`` measures the load times alone (the throughput figures are null), for a quick look or a
model too large to generate with on the machine at hand (the demo's 500M takes ~4 minutes whole on 2 cores).

fp32, greedy, EOS ignored, every request asks for --output-tokens tokens. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from keepwarm_runtime.bench_cli import publish
from keepwarm_runtime.engine import threads

# As `keepwarm serve` does, before torch is imported: OpenMP threads that spin a bounded while, then
# sleep (engine/threads.py); without it a loaded CPU stalls each of an adapter load's many small ops.
threads.prepare_openmp(threads.choose_threads())

import torch  # noqa: E402

from keepwarm_runtime import LLM, SamplingParams  # noqa: E402
from keepwarm_runtime.cache.launcher import DaemonProcess  # noqa: E402
from keepwarm_runtime.engine.llm import LoRARequest  # noqa: E402
from keepwarm_runtime.engine.lora.adapter import AdapterCache  # noqa: E402

RATES = ("base_tok_s", "mixed_tok_s", "peft_tok_s", "mixed_over_base", "mixed_over_peft")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(model_dir: Path, out: Path, rank: int, seed: int) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.02)
    model.save_pretrained(out)
    return out


def load_ms(llm: LLM, path: Path, cache: AdapterCache, reps: int = 9) -> float:
    """Median ms to register an adapter through ``cache`` and copy it into a slot (then forget it)."""
    engine, times = llm.engine, []
    engine.lora.cache = cache  # where adapters come from: the node cache or disk
    want = "cache" if cache.socket_dir else "disk"
    for i in range(reps):
        name = f"probe-{i}"
        start = time.perf_counter()
        weights = engine.add_lora(name, str(path))
        assert engine.lora.acquire(name)
        times.append((time.perf_counter() - start) * 1000)
        assert weights.source == want, f"{path} came from {weights.source} ({weights.reason}), not {want}"
        engine.lora.release(name)
        engine.remove_lora(name)
    return round(statistics.median(times), 2)


def keepwarm_tok_s(llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None], tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
    return len(prompts) * tokens / elapsed


def peft_runner(model_dir: Path, adapters: list[Path], prompts: list[list[int]], tokens: int):
    """PEFT's way, loaded once: a function returning tokens/s of one pass over the prompts, per
    adapter in turn (``set_adapter``, then ``generate()`` on that adapter's prompts as one batch)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapters[0], adapter_name="a0")
    for i, path in enumerate(adapters[1:], 1):
        model.load_adapter(path, adapter_name=f"a{i}")

    def run() -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            for i in range(len(adapters)):
                mine = prompts[i :: len(adapters)]
                model.set_adapter(f"a{i}")
                ids = torch.tensor(mine)
                model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=tokens,
                    min_new_tokens=tokens,
                    do_sample=False,
                    pad_token_id=0,
                )
        return len(prompts) * tokens / (time.perf_counter() - start)

    return run


def throughput(llm: LLM, model_dir: Path, mixed: list[Path], args: argparse.Namespace) -> dict[str, float]:
    """Base-only, mixed-adapter and PEFT tokens/s over the same random prompts, and their ratios.

    --rounds passes of each, the order rotating every round, the best of each kept: on a shared
    machine the speed drifts by tens of percent over seconds, and one pass each would measure it."""
    g = torch.Generator().manual_seed(0)
    vocab = llm.engine.vocab_size
    shape = (args.prompt_len,)
    prompts = [torch.randint(10, vocab, shape, generator=g).tolist() for _ in range(args.prompts)]
    requests = [LoRARequest(f"m{i}", i + 1, str(p)) for i, p in enumerate(mixed)]
    keepwarm_tok_s(llm, prompts[:2], [None, requests[0]], 2)  # warm-up: first-pass costs, registration
    loras = [requests[i % len(requests)] for i in range(len(prompts))]
    runs = {
        "base": lambda: keepwarm_tok_s(llm, prompts, [None] * len(prompts), args.output_tokens),
        "mixed": lambda: keepwarm_tok_s(llm, prompts, loras, args.output_tokens),
        "peft": peft_runner(model_dir, mixed, prompts, args.output_tokens),
    }
    best = dict.fromkeys(runs, 0.0)
    names = list(runs)
    for round_ in range(args.rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            best[name] = max(best[name], runs[name]())
    base, mixed_rate, peft = best["base"], best["mixed"], best["peft"]
    values = (base, mixed_rate, peft, mixed_rate / base, mixed_rate / peft)
    return {name: round(v, 1 if name.endswith("tok_s") else 3) for name, v in zip(RATES, values, strict=True)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="10M")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--ranks", default="8,16,64")
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="passes of each throughput case, best kept")
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument("--load-only", action="store_true", help="measure adapter load times only")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    ranks = [int(r) for r in args.ranks.split(",")]
    mixed_rank = ranks[len(ranks) // 2]

    with tempfile.TemporaryDirectory(prefix="kw-bench-lora-") as tmp:
        root = Path(tmp)
        model_dir = args.model_dir
        if model_dir is None:
            from keepwarm_runtime.modelgen import make_model

            model_dir = make_model(root / "model", arch="llama", params=args.params, dtype="float32")
        by_rank = {r: make_adapter(model_dir, root / f"rank{r}", r, seed=r) for r in ranks}
        mixed = [
            make_adapter(model_dir, root / f"mixed{i}", mixed_rank, seed=100 + i)
            for i in range(0 if args.load_only else args.adapters)
        ]
        llm = LLM(
            model_dir, dtype="float32", enable_lora=True, max_loras=args.adapters, max_lora_rank=max(ranks)
        )
        socket_dir = root / "wc"
        cached = [arg for path in by_rank.values() for arg in ("--adapter", str(path))]
        daemon = DaemonProcess(socket_dir, [], "--dtype", "float32", *cached).wait_ready()
        try:
            cache = AdapterCache(str(socket_dir))
            from_disk = {str(r): load_ms(llm, path, AdapterCache()) for r, path in by_rank.items()}
            from_cache = {str(r): load_ms(llm, path, cache) for r, path in by_rank.items()}
        finally:
            daemon.kill()
        llm.engine.lora.cache = AdapterCache()
        rates = None if args.load_only else throughput(llm, model_dir, mixed, args)

    result = {
        "model": str(args.model_dir or f"random llama {args.params}"),
        "threads": args.threads,
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "output_tokens": args.output_tokens,
        "adapters": args.adapters,
        "rounds": args.rounds,
        "mixed_rank": mixed_rank,
        "load_from_disk_ms": from_disk,
        "load_from_cache_ms": from_cache,
        **(rates or dict.fromkeys(RATES)),
    }
    publish(result, args.json_out)


if __name__ == "__main__":
    main()
