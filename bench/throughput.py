"""Offline throughput: keepwarm engine vs batched transformers generate(), same model, same run.

    .venv/bin/python bench/throughput.py [--params 100M] [--prompts 64] [--output-tokens 128]
        [--threads 2] [--dtype float32] [--device cpu] [--attention-backend auto] [--model-dir DIR]
        [--json-out FILE]

Generates a random-weight Llama of about --params parameters (unless --model-dir is given), then
runs the same --prompts random prompts (16..47 tokens) for exactly --output-tokens greedy tokens
each: first keepwarm's LLM.generate (continuous batching, paged KV), then transformers'
generate() on the whole batch (left padding, its default attention). Prints JSON with tokens/s of
both and their ratio, plus how many sequences agree token for token (fp32 greedy should agree
except for rare near-ties, since the padded batch differs numerically). A benchmark, not a test.
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
    params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(temperature=0, max_tokens=4))  # warm-up
    started, cpu_started = time.perf_counter(), time.process_time()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    kw_seconds = time.perf_counter() - started
    kw_cpu = time.process_time() - cpu_started
    kw_tokens = [o.outputs[0].token_ids for o in outputs]
    assert sum(len(t) for t in kw_tokens) == total_tokens
    result["keepwarm"] = {
        "seconds": round(kw_seconds, 2),
        "cpu_seconds": round(kw_cpu, 2),
        "tokens_per_s": round(total_tokens / kw_seconds, 1),
    }
    result["keepwarm"]["attention_backend"] = llm.engine.attention_backend
    del llm

    if not args.skip_hf:
        hf_seconds, hf_cpu, hf_tokens = run_hf(model_dir, prompts, args)
        result["hf_generate"] = {
            "seconds": round(hf_seconds, 2),
            "cpu_seconds": round(hf_cpu, 2),
            "tokens_per_s": round(total_tokens / hf_seconds, 1),
        }
        result["speedup"] = round(hf_seconds / kw_seconds, 2)
        result["cpu_time_ratio"] = round(hf_cpu / kw_cpu, 2)  # robust when other processes share the CPUs
        result["load_average_1m"] = os.getloadavg()[0]
        result["sequences_identical"] = sum(a == b for a, b in zip(kw_tokens, hf_tokens, strict=True))
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    if tmp is not None:
        tmp.cleanup()
    return 0


def run_hf(model_dir: str, prompts: list[list[int]], args) -> tuple[float, float, list[list[int]]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).to(args.device)
    model.eval()
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as generate() expects for decoder-only models
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(args.device), mask.to(args.device)
    n = args.output_tokens
    with torch.inference_mode():
        model.generate(
            ids[:1, -8:], attention_mask=mask[:1, -8:], max_new_tokens=4, do_sample=False, pad_token_id=0
        )
        started, cpu_started = time.perf_counter(), time.process_time()
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    return seconds, cpu, out[:, width:].tolist()


if __name__ == "__main__":
    sys.exit(main())
