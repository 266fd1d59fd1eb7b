"""keepwarm's CPU decode attention kernel alone: microseconds a call, with the caches warm and cold.

    .venv/bin/python -m bench.cpu_attention [--dtypes bfloat16,float16,float32] [--contexts 96,512]
        [--batch 64] [--heads 12] [--kv-heads 6] [--head-dim 64] [--layers 13] [--rounds 12]
        [--flush-mb 180] [--pages engine,small] [--json-out FILE]

One thread. For each dtype and context length, --layers caches of --batch sequences are filled with
random keys and values, their blocks scattered over the cache as a running engine's are, and
``torch.ops.keepwarm_cpu.paged_decode_attention`` (engine/attention/native.py) is timed on them, once
for each kind of memory in --pages (``engine``: the engine's own cache tensors, engine/kv_cache.py
``zeros``, on huge pages where they span one and the kernel gives them; ``small``: 4 KiB pages, as
before), the kinds' cold calls alternating so that the machine's moods fall on each alike:

* ``warm_us``: the median call on one layer's cache called again and again, so that it stays in the
  CPU's caches (what a kernel-only loop measures);
* ``cold_us``: the median call with each layer's cache taken in turn and --flush-mb of memory read and
  written before each call, as a decode step does between two visits to a layer (the model's weights
  and the other layers' caches), so the keys and values come from memory;
* ``cold_gb_s``: the keys' and values' bytes over ``cold_us``; ``read_gb_s`` beside it: one thread's
  sequential read of the same number of bytes after the same flush, what the memory gives at best;
* ``huge_page_bytes``: how much of one layer's keys the kernel mapped with huge pages (smaps).

The machine's CPU flags and load go with the figures (a shared VM's memory moves from run to run, so
compare kernels within one run). Prints one JSON document. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import UTC, datetime

from keepwarm_runtime.bench_cli import publish

BLOCK = 16  # tokens per cache block, the engine's default (EngineConfig.block_size)
PAGES = ("engine", "small")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="bfloat16,float16,float32")
    p.add_argument("--contexts", default="96,512", help="keys attended per sequence, comma-separated")
    p.add_argument("--batch", type=int, default=64, help="sequences per call")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=6)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=13, help="caches taken in turn for the cold figure")
    p.add_argument("--rounds", type=int, default=12, help="calls per layer (cold) and per figure (warm)")
    p.add_argument("--flush-mb", type=int, default=180, help="memory read and written before each cold call")
    p.add_argument("--pages", default="engine", help="the caches' memory, comma-separated: engine, small")
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    try:
        args.dtypes = [d for d in args.dtypes.split(",") if d]
        args.contexts = [int(c) for c in args.contexts.split(",") if c]
    except ValueError:
        p.error("--contexts: comma-separated whole numbers")
    args.pages = [k for k in args.pages.split(",") if k]
    if not args.pages or not set(args.pages) <= set(PAGES) or len(set(args.pages)) != len(args.pages):
        p.error(f"--pages: one or more of {', '.join(PAGES)}, each once")
    if not args.dtypes or not args.contexts or min(args.contexts) < 1:
        p.error("--dtypes and --contexts need at least one value each; contexts are at least 1")
    if min(args.batch, args.heads, args.kv_heads, args.head_dim, args.layers, args.rounds) < 1:
        p.error("--batch, --heads, --kv-heads, --head-dim, --layers and --rounds must be at least 1")
    if args.heads % args.kv_heads:
        p.error("--heads must be a multiple of --kv-heads")
    return args


def cache_tensor(shape: tuple[int, ...], dtype, pages: str):
    """Zeros of ``shape`` in the memory ``pages`` names (module docstring)."""
    import torch

    from keepwarm_runtime.engine.kv_cache import zeros

    return zeros(shape, dtype, torch.device("cpu"), huge_pages=pages == "engine")


def measure(dtype_name: str, context: int, args: argparse.Namespace) -> list[dict]:
    """One row per kind of --pages, for one dtype and context."""
    import torch

    from keepwarm_runtime.engine.attention import native
    from keepwarm_runtime.weights.huge_pages import pmd_mapped_bytes

    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise SystemExit(f"--dtypes: {dtype_name!r} is not a torch dtype")
    g = torch.Generator().manual_seed(0)
    per_seq = -(-context // BLOCK)
    blocks = args.batch * per_seq + 1
    shape = (blocks, BLOCK, args.kv_heads, args.head_dim)
    caches = {pages: [] for pages in args.pages}
    for _ in range(args.layers):
        k, v = torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
        for pages, layers in caches.items():
            layers.append(tuple(cache_tensor(shape, dtype, pages).copy_(t) for t in (k, v)))
    order = torch.randperm(blocks, generator=g)[: args.batch * per_seq]  # scattered, as an engine's are
    tables = order.to(torch.int32).view(args.batch, per_seq)
    query = torch.randn(args.batch, args.heads, args.head_dim, generator=g).to(dtype)
    out = torch.empty_like(query)
    starts = torch.zeros(args.batch, dtype=torch.long)
    ends = torch.full((args.batch,), context, dtype=torch.long)
    flush = torch.zeros(args.flush_mb << 18, dtype=torch.float32)  # flush_mb MiB
    scale = args.head_dim**-0.5

    def call(k: torch.Tensor, v: torch.Tensor) -> float:
        started = time.perf_counter()
        native.paged_decode_attention(out, query, k, v, tables, starts, ends, scale, None, None)
        return time.perf_counter() - started

    warm: dict[str, list[float]] = {}
    cold: dict[str, list[float]] = {pages: [] for pages in caches}
    for pages, layers in caches.items():
        for _ in range(3):
            call(*layers[0])
        warm[pages] = [call(*layers[0]) for _ in range(args.rounds)]
    for _ in range(args.rounds):
        for layer in range(args.layers):
            for pages, layers in caches.items():  # the kinds alternate, call by call
                flush.add_(1)
                cold[pages].append(call(*layers[layer]))
    kv_bytes = 2 * args.batch * context * args.kv_heads * args.head_dim * dtype.itemsize
    sequential = torch.zeros(kv_bytes // 4, dtype=torch.float32)
    reads = []
    for _ in range(args.rounds):
        flush.add_(1)
        started = time.perf_counter()
        sequential.sum()
        reads.append(time.perf_counter() - started)
    read_gb_s = round(kv_bytes / statistics.median(reads) / 1e9, 2)
    rows = []
    for pages, layers in caches.items():
        cold_s = statistics.median(cold[pages])
        k = layers[0][0]
        rows.append(
            {
                "dtype": dtype_name,
                "context": context,
                "pages": pages,
                "huge_page_bytes": pmd_mapped_bytes(k.data_ptr()),  # of one layer's keys
                "kv_bytes": kv_bytes,
                "warm_us": round(statistics.median(warm[pages]) * 1e6, 1),
                "cold_us": round(cold_s * 1e6, 1),
                "cold_gb_s": round(kv_bytes / cold_s / 1e9, 2),
                "read_gb_s": read_gb_s,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from keepwarm_runtime.engine import threads

    threads.use_threads(threads.ThreadChoice(1, "one thread"))  # before torch is imported, as serve does
    import torch

    from bench.step import machine
    from keepwarm_runtime.engine.attention import native

    native.load()
    result: dict = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "kernel": native.library_name(),
        "shape": {
            "batch": args.batch,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "block": BLOCK,
            "layers": args.layers,
            "flush_mb": args.flush_mb,
        },
        "machine": machine(),
        "rows": [],
    }
    for dtype_name in args.dtypes:
        for context in args.contexts:
            for row in measure(dtype_name, context, args):
                result["rows"].append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    result["load_average_1m_after"] = round(os.getloadavg()[0], 2)
    publish(result, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
