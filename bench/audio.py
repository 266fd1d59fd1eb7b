"""Audio decode + resample throughput per backend at 1, 8 and 32 concurrent requests.

    .venv/bin/python bench/audio.py [--format mp3] [--seconds 10] [--rate 44100] [--channels 2]
        [--target-rate 16000] [--concurrency 1 8 32] [--requests 64] [--rounds 3] [--json-out FILE]

Encodes one clip (a chirp plus noise, so the codec has real work) in --format, then for each backend
runs --requests load_audio calls (at least one per worker) on a thread pool of each concurrency,
as the server does. The backends take turns, --rounds times, and each (backend, concurrency) keeps
its best round: on a shared machine whose load drifts, running one backend after the other would
compare the load as much as the decoders. Prints JSON: audio seconds decoded per wall second per
backend and concurrency, and the torchcodec/pyav ratio at each concurrency. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from keepwarm_runtime.bench_cli import publish

FORMATS = {  # soundfile (format, subtype) per --format
    "wav": ("WAV", "PCM_16"),
    "flac": ("FLAC", "PCM_16"),
    "mp3": ("MP3", "MPEG_LAYER_III"),
    "opus": ("OGG", "OPUS"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--format", choices=sorted(FORMATS), default="mp3")
    p.add_argument("--seconds", type=float, default=10.0, help="clip length")
    p.add_argument("--rate", type=int, default=44100, help="clip sample rate (opus: 48000)")
    p.add_argument("--channels", type=int, default=2)
    p.add_argument("--target-rate", type=int, default=16000, help="what load_audio resamples to")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--requests", type=int, default=64, help="load_audio calls per (backend, concurrency)")
    p.add_argument("--rounds", type=int, default=3, help="turns per backend; the best one is reported")
    p.add_argument("--backends", nargs="+", default=None, help="default: every backend that loads")
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


def make_clip(fmt: str, seconds: float, rate: int, channels: int) -> bytes:
    import soundfile as sf

    t = np.arange(int(seconds * rate)) / rate
    chirp = 0.4 * np.sin(2 * np.pi * (200 + 300 * t) * t)
    noise = np.random.default_rng(0).normal(0, 0.05, (len(t), channels))
    samples = (chirp[:, None] + noise).astype(np.float32)
    container, subtype = FORMATS[fmt]
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format=container, subtype=subtype)
    return buf.getvalue()


def throughput(backend: str, clip: bytes, target_rate: int, workers: int, requests: int) -> dict:
    from keepwarm_runtime.audio import load_audio

    def one(_: int) -> float:
        return load_audio(clip, sample_rate=target_rate, backend=backend).duration_s

    count = max(requests, workers)
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        audio_s = sum(pool.map(one, range(count)))
    wall = time.perf_counter() - started
    return {
        "requests": count,
        "audio_s": round(audio_s, 3),
        "wall_s": round(wall, 4),
        "audio_s_per_wall_s": round(audio_s / wall, 1),
    }


def available_backends() -> list[str]:
    from keepwarm_runtime.audio import AUTO_ORDER, BACKENDS
    from keepwarm_runtime.audio.errors import BackendUnavailable

    names = []
    for name in AUTO_ORDER:
        try:
            BACKENDS[name].available()
            names.append(name)
        except BackendUnavailable as exc:
            print(f"skipping {name}: {exc}", file=sys.stderr)
    return names


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(1)  # the server resamples in request threads; one core each, like the decoders
    clip = make_clip(args.format, args.seconds, args.rate, args.channels)
    backends = args.backends or available_backends()
    from keepwarm_runtime.audio import load_audio

    for backend in backends:  # warm: library loading is not throughput
        load_audio(clip, sample_rate=args.target_rate, backend=backend)
    results: dict[str, dict[str, dict]] = {b: {} for b in backends}
    for _ in range(args.rounds):
        for c in args.concurrency:
            for backend in backends:
                run = throughput(backend, clip, args.target_rate, c, args.requests)
                best = results[backend].get(str(c))
                if best is None or run["audio_s_per_wall_s"] > best["audio_s_per_wall_s"]:
                    results[backend][str(c)] = run
    ratio = {}
    if "torchcodec" in results and "pyav" in results:
        ratio = {
            c: round(
                results["torchcodec"][c]["audio_s_per_wall_s"] / results["pyav"][c]["audio_s_per_wall_s"], 2
            )
            for c in results["torchcodec"]
        }
    report = {
        "machine": {"cpus": os.cpu_count(), "load_1m": round(os.getloadavg()[0], 2)},  # at the end
        "clip": {
            "format": args.format,
            "seconds": args.seconds,
            "rate": args.rate,
            "channels": args.channels,
            "bytes": len(clip),
        },
        "target_rate": args.target_rate,
        "rounds": args.rounds,
        "throughput": results,
        "torchcodec_over_pyav": ratio,
    }
    publish(report, args.json_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
