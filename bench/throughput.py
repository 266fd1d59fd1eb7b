"""Offline throughput: keepwarm engine vs batched transformers generate(), same model, same run.

    .venv/bin/python bench/throughput.py [--params 100M] [--prompts 64] [--output-tokens 128]
        [--threads 2] [--dtype float32] [--device cpu] [--attention-backend auto] [--model-dir DIR]
        [--rounds 2] [--json-out FILE]

Generates a random-weight Llama of about --params parameters (unless --model-dir is given), then
runs the same --prompts random prompts (16..47 tokens) for exactly --output-tokens greedy tokens
each: keepwarm's LLM.generate (continuous batching, paged KV) and transformers' generate() on the
whole batch (left padding, its default attention), in --rounds alternating rounds (best of each).
Prints JSON with tokens/s of both and their ratio, plus how many sequences agree token for token
(fp32 greedy should agree except for rare near-ties, since the padded batch differs numerically).
A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", default="100M")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--attention-backend", default="auto", help="auto | torch | flashinfer")
    p.add_argument("--model-dir", default=None)
    p.add_argument("--skip-hf", action="store_true", help="only run keepwarm")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds; the best of each is compared")
    p.add_argument("--json-out", default=None)
    return p.parse_args()


def main() -> int:
    args = parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    from keepwarm_runtime import LLM, SamplingParams
    from keepwarm_runtime.modelgen import make_model

    tmp = None
    model_dir = args.model_dir
    if model_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="keepwarm-bench-")
        started = time.perf_counter()
        model_dir = str(
            make_model(Path(tmp.name) / "model", arch="llama", params=args.params, dtype=args.dtype)
        )
        print(f"generated model in {time.perf_counter() - started:.1f}s", file=sys.stderr)

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 8000, (16 + i % 32,), generator=g).tolist() for i in range(args.prompts)]
    total_tokens = args.prompts * args.output_tokens
    result: dict = {
        "model_params": args.params,
        "prompts": args.prompts,
        "output_tokens": args.output_tokens,
        "threads": args.threads,
        "dtype": args.dtype,
        "device": args.device,
        "machine": f"{os.cpu_count()} CPUs",
    }

    llm = LLM(
        model_dir,
        dtype=args.dtype,
        device=args.device,
        attention_backend=args.attention_backend,
        max_num_seqs=args.prompts,
        max_num_batched_tokens=4096,
    )
    llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(temperature=0, max_tokens=4))  # warm-up
    result["keepwarm"] = {"attention_backend": llm.engine.attention_backend}
    hf = None if args.skip_hf else HFBatch(model_dir, prompts, args)
    # Rounds alternate which engine goes first, and the best round of each is compared: on a shared
    # machine the speed drifts by tens of percent over minutes, and one pass each would measure the drift.
    runs: dict[str, list[tuple[float, float]]] = {"keepwarm": [], "hf_generate": []}
    for round_ in range(args.rounds):
        order = ["keepwarm", "hf_generate"] if round_ % 2 == 0 else ["hf_generate", "keepwarm"]
        for name in order:
            if name == "keepwarm":
                seconds, cpu, kw_tokens = time_keepwarm(llm, prompts, args.output_tokens)
            elif hf is not None:
                seconds, cpu, hf_tokens = hf.run()
            else:
                continue
            runs[name].append((seconds, cpu))
    assert sum(len(t) for t in kw_tokens) == total_tokens
    for name, timings in runs.items():
        if not timings:
            continue
        seconds, cpu = min(timings)
        result[name] = result.get(name, {}) | {
            "seconds": round(seconds, 2),
            "cpu_seconds": round(cpu, 2),
            "tokens_per_s": round(total_tokens / seconds, 1),
            "rounds_s": [round(t, 2) for t, _ in timings],
        }
    if hf is not None:
        result["speedup"] = round(result["hf_generate"]["seconds"] / result["keepwarm"]["seconds"], 2)
        result["cpu_time_ratio"] = round(
            result["hf_generate"]["cpu_seconds"] / result["keepwarm"]["cpu_seconds"], 2
        )
        result["load_average_1m"] = os.getloadavg()[0]
        result["sequences_identical"] = sum(a == b for a, b in zip(kw_tokens, hf_tokens, strict=True))
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    if tmp is not None:
        tmp.cleanup()
    return 0


def time_keepwarm(llm, prompts: list[list[int]], output_tokens: int) -> tuple[float, float, list[list[int]]]:
    from keepwarm_runtime import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_tokens, ignore_eos=True)
    started, cpu_started = time.perf_counter(), time.process_time()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    return seconds, cpu, [o.outputs[0].token_ids for o in outputs]


class HFBatch:
    """transformers generate() on the whole batch, left-padded, loaded once."""

    def __init__(self, model_dir: str, prompts: list[list[int]], args) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype))
        self.model.to(args.device).eval()
        self.width = width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding, as generate() expects for decoder-only models
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        self.ids, self.mask = ids.to(args.device), mask.to(args.device)
        self.new_tokens = args.output_tokens
        self._generate(self.ids[:1, -8:], self.mask[:1, -8:], 4)  # warm-up

    def _generate(self, ids, mask, n: int):
        import torch

        with torch.inference_mode():
            return self.model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )

    def run(self) -> tuple[float, float, list[list[int]]]:
        started, cpu_started = time.perf_counter(), time.process_time()
        out = self._generate(self.ids, self.mask, self.new_tokens)
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        return seconds, cpu, out[:, self.width :].tolist()


if __name__ == "__main__":
    sys.exit(main())
