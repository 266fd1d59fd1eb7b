"""`keepwarm make-model`: generate a random-weight checkpoint."""

from __future__ import annotations

import argparse
import json
import sys

from keepwarm_api.values import SERVING_DTYPES, DType


def register(subparsers: argparse._SubParsersAction) -> None:
    from keepwarm_runtime.modelgen.architectures import ARCHITECTURES

    parser = subparsers.add_parser("make-model", help="write a random-weight Hugging Face checkpoint")
    parser.add_argument("out", help="output directory")
    parser.add_argument("--arch", default="llama", choices=sorted(ARCHITECTURES))
    parser.add_argument("--params", default="1M", help="approximate parameter count, e.g. 100M, 1.5B")
    parser.add_argument("--dtype", default=DType.BFLOAT16.value, choices=SERVING_DTYPES)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shards", type=int, default=2, help="number of safetensors shards")
    parser.add_argument(
        "--fp8",
        action="store_true",
        help="store linear and expert weights as FP8 e4m3 with 128x128 block scales (quant_method fp8)",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from keepwarm_runtime.modelgen.checkpoint import make_model, parse_param_count

    try:
        params = parse_param_count(args.params)
    except ValueError as exc:
        print(f"keepwarm make-model: {exc}", file=sys.stderr)
        return 2
    out = make_model(
        args.out,
        arch=args.arch,
        params=params,
        dtype=args.dtype,
        vocab_size=args.vocab_size,
        seed=args.seed,
        num_shards=args.shards,
    )
    if args.fp8:
        from keepwarm_runtime.modelgen.fp8 import quantize_checkpoint

        quantize_checkpoint(out)
    files = sorted(p.name for p in out.iterdir())
    print(json.dumps({"out": str(out), "arch": args.arch, "files": files}))
    return 0
