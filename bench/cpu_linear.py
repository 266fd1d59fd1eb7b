"""Linear layers on CPU, per step size: keepwarm's AMX and AVX-512 kernels beside oneDNN (bfloat16) and
its AVX-512 kernel beside MKL (float32), weights from memory.

    .venv/bin/python -m bench.cpu_linear [--dtype bfloat16] [--rows 1,8,32,64,128] [--hidden 768]
        [--intermediate 2048] [--heads 12] [--kv-heads 6] [--head-dim 64] [--layers 40] [--rounds 9]
        [--json-out FILE]

One thread. A Llama decoder layer's seven projections (q, k, v, o, gate, up, down; default: the 100M
Llama that `bench/throughput.py` generates) in --layers copies, more bytes than the CPU's last-level
cache by default (40 x 13 MB), as a decode step reads them: each layer once, from memory. For each
number of rows (tokens in the step), every layer is run once in turn with each way to multiply, in
rotating order per round, and the median round is reported. bfloat16 (``--dtype bfloat16``):

* ``amx``: ``torch.ops.keepwarm_cpu.amx_linear`` (engine/attention/csrc/amx_linear.cpp), the weight
  read where it lies; absent, with the reason, where the CPU or the build has no AMX;
* ``bf16_kernel``: ``torch.ops.keepwarm_cpu.bf16_linear`` (engine/attention/csrc/avx512_linear.cpp),
  the weight read where it lies and widened to float32, PackedLinear's path where the CPU has AVX-512
  BF16 and no AMX; absent, with the reason, without AVX-512 BF16;
* ``onednn_packed``: oneDNN on the weight reordered once into its blocked layout (PackedLinear's path,
  engine/cpu_linear.py);
* ``f_linear``: ``torch.nn.functional.linear``, oneDNN reordering the weight on every call;
* ``amx_mlp_separate`` and ``amx_mlp_as_one``: the layer as the engine runs it with AMX, the MLP's
  SiLU-and-mul included: gate and up as two ``amx_linear`` calls and the SiLU-and-mul kernel, or as
  one ``amx_gate_up_silu`` (engine/cpu_fused.py takes the second; the same bits).

float32 (``--dtype float32``; the weights twice the bytes):

* ``f32_kernel``: ``torch.ops.keepwarm_cpu.f32_linear`` (engine/attention/csrc/avx512_linear.cpp), the
  weight read where it lies, the output written in rows; absent, with the reason, without AVX-512;
* ``weight_major``: MKL's ``(W @ x.T).T`` made contiguous, WeightMajorLinear's path without the kernel
  (engine/cpu_linear.py);
* ``f_linear``: ``torch.nn.functional.linear``, MKL's sgemm with the rows as its left operand.

Each as milliseconds for all the layers and as the weights' bytes over that time (GB/s), beside the
machine's CPU flags and load (a shared VM's memory moves from run to run: compare within one run).
Prints one JSON document. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from datetime import UTC, datetime

from keepwarm_api.values import DType
from keepwarm_runtime.bench_cli import publish

LINEAR_DTYPES = (DType.BFLOAT16.value, DType.FLOAT32.value)  # the dtypes keepwarm's linear kernels serve


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default=DType.BFLOAT16.value, choices=LINEAR_DTYPES)
    p.add_argument("--rows", default="1,8,32,64,128", help="tokens per step, comma-separated")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=6)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=40, help="decoder layers' weights, each read once a round")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    try:
        args.rows = [int(r) for r in args.rows.split(",") if r]
    except ValueError:
        p.error("--rows: comma-separated whole numbers")
    sizes = (
        args.hidden,
        args.intermediate,
        args.heads,
        args.kv_heads,
        args.head_dim,
        args.layers,
        args.rounds,
    )
    if not args.rows or min(args.rows) < 1 or min(sizes) < 1:
        p.error("--rows and every size must be at least 1")
    return args


def projections(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(out_features, in_features) of a Llama decoder layer's q, k, v, o, gate, up and down."""
    q, kv, h, i = args.heads * args.head_dim, args.kv_heads * args.head_dim, args.hidden, args.intermediate
    return [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)]


def each_projection(shapes: list[tuple[int, int]], way):
    """A layer's run: ``way(x, weight, packed)`` for each projection, on the input of its width."""

    def run(inputs, layer, layer_packed) -> None:
        for (_, i), w, p in zip(shapes, layer, layer_packed, strict=True):
            way(inputs[i], w, p)

    return run


def amx_layer(shapes: list[tuple[int, int]], gate_up_as_one: bool):
    """A layer's run on AMX as the engine's fused MLP takes it (q, k, v, o, gate, up, down)."""
    import torch

    from keepwarm_runtime.engine.attention import native

    silu_and_mul = getattr(torch.ops, native.OP_NAMESPACE).silu_and_mul
    hidden = shapes[4][1]

    def run(inputs, layer, layer_packed) -> None:
        q, k, v, o, gate, up, down = layer
        x = inputs[hidden]
        for w in (q, k, v):
            native.amx_linear(x, w, None)
        native.amx_linear(inputs[o.shape[1]], o, None)
        if gate_up_as_one:
            act = native.amx_gate_up_silu(x, gate, up)
        else:
            g, u = native.amx_linear(x, gate, None), native.amx_linear(x, up, None)
            act = torch.empty_like(g)
            silu_and_mul(act, g, u)
        native.amx_linear(act, down, None)

    return run


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from keepwarm_runtime.engine import threads

    threads.use_threads(threads.ThreadChoice(1, "one thread"))  # before torch is imported, as serve does
    import time

    import torch
    import torch.nn.functional as F

    from bench.step import machine
    from keepwarm_runtime.engine.attention import native
    from keepwarm_runtime.engine.cpu_linear import amx_takes, avx512_kernel_takes, weight_major

    native.load()
    shapes = projections(args)
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    weights = [
        [(torch.randn(o, i, generator=g) / i**0.5).to(dtype) for o, i in shapes] for _ in range(args.layers)
    ]
    packed = [[None] * len(shapes) for _ in weights]
    per_projection = {"f_linear": lambda x, w, packed: F.linear(x, w)}
    skipped: dict[str, str] = {}
    layer_ways = {}  # ways that run a whole layer, beside the per-projection ones
    if dtype == torch.float32:
        per_projection["weight_major"] = lambda x, w, p: weight_major(x, w)
        if native.f32_linear_available() and all(avx512_kernel_takes(o) for o, _ in shapes):
            per_projection["f32_kernel"] = lambda x, w, p: native.f32_linear(x, w, None)
        else:
            skipped["f32_kernel"] = "N % 4 != 0" if native.f32_linear_available() else "no AVX-512 here"
    else:
        if torch.ops.mkldnn._is_mkldnn_bf16_supported():
            packed = [[torch.ops.mkldnn._reorder_linear_weight(w) for w in layer] for layer in weights]
            per_projection["onednn_packed"] = lambda x, w, p: torch.ops.mkldnn._linear_pointwise(
                x, p, None, "none", [], ""
            )
        else:
            skipped["onednn_packed"] = "oneDNN has no native bfloat16 on this CPU"
        if native.bf16_linear_available() and all(avx512_kernel_takes(o) for o, _ in shapes):
            per_projection["bf16_kernel"] = lambda x, w, p: native.bf16_linear(x, w, None)
        else:
            skipped["bf16_kernel"] = (
                "N % 4 != 0" if native.bf16_linear_available() else "no AVX-512 BF16 here"
            )
        fits = all(amx_takes(o, i) for o, i in shapes)
        if native.amx_linear_available() and fits:
            per_projection["amx"] = lambda x, w, p: native.amx_linear(x, w, None)
        else:
            skipped["amx"] = "no AMX tiles here" if fits else "shapes need K % 32 == 0 and N % 16 == 0"
        if "amx" in per_projection:
            layer_ways["amx_mlp_separate"] = amx_layer(shapes, gate_up_as_one=False)
            layer_ways["amx_mlp_as_one"] = amx_layer(shapes, gate_up_as_one=True)
    ways = {name: each_projection(shapes, way) for name, way in per_projection.items()} | layer_ways
    weight_bytes = sum(o * i for o, i in shapes) * dtype.itemsize * args.layers

    rows_out = []
    for rows in args.rows:
        inputs = {i: torch.randn(rows, i, generator=g).to(dtype) for i in {i for _, i in shapes}}
        names = list(ways)
        times: dict[str, list[float]] = {name: [] for name in names}
        for round_ in range(args.rounds + 1):  # the first round warms up, uncounted
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                way = ways[name]
                started = time.perf_counter()
                for layer, layer_packed in zip(weights, packed, strict=True):
                    way(inputs, layer, layer_packed)
                if round_:
                    times[name].append(time.perf_counter() - started)
        row: dict = {"rows": rows}
        for name in names:
            seconds = statistics.median(times[name])
            row[name] = {"ms": round(seconds * 1e3, 3), "gb_s": round(weight_bytes / seconds / 1e9, 2)}
        if "amx" in row and "onednn_packed" in row:
            row["amx_speedup_vs_onednn_packed"] = round(row["onednn_packed"]["ms"] / row["amx"]["ms"], 3)
        if "bf16_kernel" in row and "onednn_packed" in row:
            speedup = row["onednn_packed"]["ms"] / row["bf16_kernel"]["ms"]
            row["bf16_kernel_speedup_vs_onednn_packed"] = round(speedup, 3)
        if "f32_kernel" in row:
            row["f32_speedup_vs_weight_major"] = round(row["weight_major"]["ms"] / row["f32_kernel"]["ms"], 3)
        if "amx_mlp_as_one" in row:
            separate, as_one = row["amx_mlp_separate"]["ms"], row["amx_mlp_as_one"]["ms"]
            row["mlp_as_one_speedup"] = round(separate / as_one, 3)
        rows_out.append(row)
        print(row, file=sys.stderr, flush=True)
    result = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "dtype": args.dtype,
        "kernel": native.library_name(),
        "projections": [list(shape) for shape in shapes],
        "layers": args.layers,
        "weight_bytes": weight_bytes,
        "skipped": skipped,
        "machine": machine(),
        "rows": rows_out,
        "load_average_1m_after": round(os.getloadavg()[0], 2),
    }
    publish(result, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
