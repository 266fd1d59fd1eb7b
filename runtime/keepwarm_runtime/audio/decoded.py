"""What a backend hands back, and the guard it calls before it decodes.

Backends return the samples at whatever rate they produced (the target rate when they resample
themselves) with what the container's header claimed, so ``load_audio`` can catch truncation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# Called with (duration in seconds or None when unknown, channel count) before decoding starts and,
# by frame-by-frame backends, as decoding goes; raises AudioTooLong.
Guard = Callable[[float | None, int], None]

# Codecs whose header gives the exact sample count (a shorter decode means a truncated file).
_EXACT_PREFIXES = ("pcm_", "flac")


@dataclass(frozen=True)
class BackendOutput:
    samples: torch.Tensor  # float32 [channels, n]
    sample_rate: int  # Hz of ``samples``
    header_duration_s: float | None  # what the container claims; None when it does not say
    header_exact: bool  # True when the header's duration is exact (PCM, FLAC), not an estimate


def exact_codec(codec_name: str | None) -> bool:
    """True for codecs whose container header states the exact length."""
    return bool(codec_name) and codec_name.lower().startswith(_EXACT_PREFIXES)
