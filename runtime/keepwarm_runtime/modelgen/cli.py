"""`keepwarm make-model`: generate a random-weight checkpoint (a text model sized by --params, or a
fixed tiny audio model: whisper, qwen2_audio, voxtral)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from keepwarm_api.values import SERVING_DTYPES, DType

# Flags that size a text model; an audio architecture is a fixed tiny model and refuses them.
SIZING_FLAGS = {"params": "--params", "vocab_size": "--vocab-size", "shards": "--shards", "fp8": "--fp8"}


def register(subparsers: argparse._SubParsersAction) -> None:
    from keepwarm_runtime.modelgen.architectures import ARCHITECTURES
    from keepwarm_runtime.modelgen.audio import AUDIO_ARCHITECTURES

    parser = subparsers.add_parser("make-model", help="write a random-weight Hugging Face checkpoint")
    parser.add_argument("out", help="output directory")
    parser.add_argument(
        "--arch",
        default="llama",
        choices=sorted([*ARCHITECTURES, *AUDIO_ARCHITECTURES]),
        help=f"{', '.join(AUDIO_ARCHITECTURES)}: a fixed tiny audio model (the sizing flags do not apply)",
    )
    parser.add_argument("--params", help="approximate parameter count, e.g. 100M, 1.5B (default 1M)")
    parser.add_argument("--dtype", default=DType.BFLOAT16.value, choices=SERVING_DTYPES)
    parser.add_argument("--vocab-size", type=int, help="tokenizer vocabulary size (default 8192)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shards", type=int, help="number of safetensors shards (default 2)")
    parser.add_argument(
        "--fp8",
        action="store_true",
        help="store linear and expert weights as FP8 e4m3 with 128x128 block scales (quant_method fp8)",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from keepwarm_runtime.modelgen.audio import AUDIO_ARCHITECTURES

    if args.arch in AUDIO_ARCHITECTURES:
        given = [flag for name, flag in SIZING_FLAGS.items() if getattr(args, name) not in (None, False)]
        if given:
            print(f"keepwarm make-model: {', '.join(given)} not for --arch {args.arch}", file=sys.stderr)
            return 2
        from keepwarm_runtime.modelgen.audio import make_audio_model

        out = make_audio_model(args.out, args.arch, dtype=args.dtype, seed=args.seed)
    else:
        out = make_text_model(args)
        if out is None:
            return 2
    files = sorted(p.name for p in out.iterdir())
    print(json.dumps({"out": str(out), "arch": args.arch, "files": files}))
    return 0


def make_text_model(args: argparse.Namespace) -> Path | None:
    """The checkpoint's path, or None after naming a bad --params; unset flags take make_model's defaults."""
    from keepwarm_runtime.modelgen.checkpoint import make_model, parse_param_count

    sizing = {"vocab_size": args.vocab_size, "num_shards": args.shards}
    try:
        if args.params is not None:
            sizing["params"] = parse_param_count(args.params)
    except ValueError as exc:
        print(f"keepwarm make-model: {exc}", file=sys.stderr)
        return None
    kwargs = {k: v for k, v in sizing.items() if v is not None}
    out = make_model(args.out, arch=args.arch, dtype=args.dtype, seed=args.seed, **kwargs)
    if args.fp8:
        from keepwarm_runtime.modelgen.fp8 import quantize_checkpoint

        quantize_checkpoint(out)
    return out
