"""What the audio integration modules share: a real `keepwarm serve` of a tiny audio model, the
official openai client on it, and the noise clips both sides decode to the same samples."""

from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import openai

from keepwarm_runtime.server.launcher import ServerProcess, start_server


@contextmanager
def audio_server(model_dir: Path, log: Path, args: list[str]) -> Iterator[ServerProcess]:
    """`keepwarm serve MODEL_DIR ARGS` with one intra-op thread, handed out once /ready answers."""
    proc = start_server(model_dir, log, args=args, env={"OMP_NUM_THREADS": "1"})
    try:
        proc.wait("/ready", timeout=240)
        yield proc
    finally:
        proc.stop()


def openai_client(server: ServerProcess, timeout: float = 120) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=timeout)


def noise_wav(seed: int, seconds: float) -> tuple[bytes, np.ndarray]:
    """A 16 kHz PCM-16 WAV of seeded noise, and the float32 samples it decodes to."""
    import soundfile as sf

    samples = np.random.default_rng(seed).normal(0, 0.1, int(16000 * seconds)).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, samples, 16000, format="WAV", subtype="PCM_16")
    data = buf.getvalue()
    decoded, _ = sf.read(io.BytesIO(data), dtype="float32")
    return data, decoded
