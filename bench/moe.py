"""One MoE layer, per backend and weight format: tokens/s at batch 1, 16 and 256, and FP8/bf16 bytes.

    .venv/bin/python bench/moe.py [--experts 8] [--hidden 1024] [--intermediate 512] [--top-k 2]
        [--device cpu] [--threads 2] [--repeats 5] [--skip-flashinfer] [--json-out FILE]

Random expert weights and random routing (the router is the model's and is not timed). Backends:
keepwarm's torch reference on bf16 and on FP8 128x128 block weights (dequantized per expert),
transformers' grouped_mm experts as the baseline, and FlashInfer's CUTLASS kernel where the oracle
says it is eligible on this device (CUDA with flashinfer-python). Each row says whether the backend
ran or why not, and each non-reference backend its largest error relative to the torch reference at
batch 16 (the FlashInfer kernel's parity check in scripts/gpu-check). Prints JSON; a benchmark, not a
test.
"""

from __future__ import annotations

import argparse
import os
import time

from keepwarm_runtime.bench_cli import publish

BATCHES = (1, 16, 256)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--skip-flashinfer", action="store_true", help="torch and transformers only (no kernel JIT)"
    )
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


def _time(fn, repeats: int, sync) -> float:
    fn()  # warm-up (and autotuning, for kernels that do)
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    from keepwarm_runtime.engine.moe.activation import GatedActivation
    from keepwarm_runtime.engine.moe.experts import layer_facts
    from keepwarm_runtime.engine.moe.oracle import ELIGIBILITY
    from keepwarm_runtime.engine.moe.reference import ExpertWeights, reference_moe
    from keepwarm_runtime.weights.fp8 import quantize_blocks

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    g = torch.Generator().manual_seed(0)
    E, H, inter = args.experts, args.hidden, args.intermediate
    gate_up = (torch.randn(E, 2 * inter, H, generator=g) / H**0.5).to(device, torch.bfloat16)
    down = (torch.randn(E, H, inter, generator=g) / inter**0.5).to(device, torch.bfloat16)
    (gu_q, gu_s), (d_q, d_s) = quantize_blocks(gate_up), quantize_blocks(down)
    formats = {
        "bf16": ExpertWeights(gate_up, down),
        "fp8_block128": ExpertWeights(gu_q, d_q, gate_up_scale_inv=gu_s, down_scale_inv=d_s),
    }
    act = GatedActivation("swiglu")
    bf16_bytes = sum(t.numel() * t.element_size() for t in (gate_up, down))
    fp8_bytes = sum(t.numel() * t.element_size() for t in (gu_q, gu_s, d_q, d_s))

    def transformers_grouped(weights: ExpertWeights):
        from types import SimpleNamespace

        from transformers.activations import ACT2FN
        from transformers.integrations.moe import _default_apply_gate, grouped_mm_experts_forward

        module = SimpleNamespace(
            gate_up_proj=weights.gate_up,
            down_proj=weights.down,
            has_gate=True,
            has_bias=False,
            is_transposed=False,
            is_concatenated=True,
            has_post_expert_norm=False,
            _is_expert_parallel=False,
            num_experts=E,
            act_fn=ACT2FN["silu"],
        )
        module._apply_gate = lambda x: _default_apply_gate(module, x)
        return lambda h, i, w: grouped_mm_experts_forward(module, h, i, w)

    runs = []
    for fmt, weights in formats.items():
        backends = {"torch": lambda h, i, w, weights=weights: reference_moe(h, i, w, weights, act)}
        if fmt == "bf16":
            backends["transformers_grouped_mm"] = transformers_grouped(weights)
        ok, reason = ELIGIBILITY["flashinfer_cutlass"](layer_facts(weights, act, capability))
        if ok and args.skip_flashinfer:
            ok, reason = False, "skipped (--skip-flashinfer)"
        if ok:
            try:
                from keepwarm_runtime.engine.moe import flashinfer_backend

                backends["flashinfer_cutlass"] = flashinfer_backend.make_runner(
                    "flashinfer_cutlass", None, weights, act
                )
            except Exception as exc:  # a benchmark reports why a backend did not run; it does not stop
                reason = f"{type(exc).__name__}: {exc}"
                ok = False
        if not ok:
            runs.append({"format": fmt, "backend": "flashinfer_cutlass", "ran": False, "reason": reason})
        for name, fn in backends.items():
            row = {"format": fmt, "backend": name, "ran": True, "tokens_per_s": {}}
            for batch in BATCHES:
                hidden = torch.randn(batch, H, generator=g).to(device, torch.bfloat16)
                index = torch.stack([torch.randperm(E, generator=g)[: args.top_k] for _ in range(batch)]).to(
                    device
                )
                scores = torch.rand(batch, args.top_k, generator=g).to(device)
                seconds = _time(lambda fn=fn, h=hidden, i=index, s=scores: fn(h, i, s), args.repeats, sync)
                row["tokens_per_s"][str(batch)] = round(batch / seconds, 1)
                if batch == 16 and name != "torch":  # parity with the torch reference, same inputs
                    expected = backends["torch"](hidden, index, scores).float()
                    got = fn(hidden, index, scores).float()
                    error = float((got - expected).abs().max()) / max(float(expected.abs().max()), 1e-6)
                    row["relative_error_vs_torch"] = round(error, 5)
            runs.append(row)
    result = {
        "bench": "moe_layer",
        "device": str(device),
        "capability": list(capability) if capability else None,
        "experts": E,
        "hidden": H,
        "intermediate": inter,
        "top_k": args.top_k,
        "threads": args.threads,
        "batches": list(BATCHES),
        "runs": runs,
        "fp8_over_bf16_bytes": round(fp8_bytes / bf16_bytes, 4),
    }
    publish(result, args.json_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
