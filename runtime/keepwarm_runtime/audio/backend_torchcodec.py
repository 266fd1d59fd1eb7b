"""The torchcodec backend: FFmpeg decodes and resamples in one call that releases the GIL.

torchcodec needs FFmpeg's shared libraries from the OS; without them its import fails, which makes
it unavailable (``auto`` moves on). FFmpeg reads every container, so a file it cannot open is corrupt.
"""

from __future__ import annotations

from keepwarm_runtime.audio.decoded import BackendOutput, Guard, exact_codec
from keepwarm_runtime.audio.errors import AudioError, BackendUnavailable, EmptyAudio

NAME = "torchcodec"
_NO_FRAMES = "No audio frames were decoded"  # torchcodec's words for a stream with no samples


def _decoder_class() -> type:
    try:
        from torchcodec.decoders import AudioDecoder
    except (ImportError, OSError, RuntimeError) as exc:
        raise BackendUnavailable(
            f"torchcodec cannot be loaded ({exc}); install FFmpeg and the audio extra"
        ) from exc
    return AudioDecoder


def available() -> None:
    """Raise BackendUnavailable when torchcodec cannot be imported."""
    _decoder_class()


def decode(data: bytes, sample_rate: int, guard: Guard) -> BackendOutput:
    decoder_class = _decoder_class()
    try:
        decoder = decoder_class(data, sample_rate=sample_rate)
        meta = decoder.metadata
    except (RuntimeError, ValueError) as exc:
        raise AudioError(f"cannot read the audio (corrupt or not audio): {_first_line(exc)}") from exc
    duration = meta.duration_seconds_from_header
    guard(duration, meta.num_channels or 1)
    try:
        samples = decoder.get_all_samples()
    except (RuntimeError, ValueError) as exc:
        if _NO_FRAMES in str(exc):
            raise EmptyAudio("the audio decodes to no samples") from exc
        raise AudioError(f"cannot decode the audio (corrupt or truncated): {_first_line(exc)}") from exc
    return BackendOutput(
        samples=samples.data.float(),
        sample_rate=samples.sample_rate,
        header_duration_s=duration,
        header_exact=exact_codec(meta.codec),
    )


def _first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
