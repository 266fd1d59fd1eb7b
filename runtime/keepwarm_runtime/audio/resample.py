"""Torch resampling and downmixing, for backends that cannot resample themselves (soundfile).

A polyphase windowed-sinc filter: the rate ratio is reduced by its gcd to ``orig:new``, each of the
``new`` output phases gets its own Hann-windowed sinc kernel, and one strided ``conv1d`` computes them
all. The low-pass cutoff sits just below the lower of the two Nyquist frequencies.
"""

from __future__ import annotations

import math

import torch

ZERO_CROSSINGS = 6  # sinc lobes on each side of a tap: sharper cutoff vs more work
ROLLOFF = 0.99  # cutoff as a fraction of the lower Nyquist frequency


def resampled_length(num_samples: int, orig_rate: int, new_rate: int) -> int:
    """How many samples ``num_samples`` at ``orig_rate`` become at ``new_rate``."""
    return math.ceil(num_samples * new_rate / orig_rate)


def _kernels(orig: int, new: int) -> tuple[torch.Tensor, int]:
    """(``new`` kernels of shape [new, 1, taps], left padding in input samples)."""
    cutoff = 0.5 * min(1.0, new / orig) * ROLLOFF  # cycles per input sample
    half_width = ZERO_CROSSINGS / (2 * cutoff)  # in input samples
    pad = math.ceil(half_width)
    offsets = torch.arange(-pad, pad + orig, dtype=torch.float64)  # input index minus m*orig
    phases = torch.arange(new, dtype=torch.float64)[:, None] * orig / new  # output position in a period
    t = phases - offsets[None, :]
    window = torch.where(t.abs() <= half_width, 0.5 * (1 + torch.cos(math.pi * t / half_width)), 0.0)
    kernels = 2 * cutoff * torch.sinc(2 * cutoff * t) * window
    return kernels.to(torch.float32)[:, None, :], pad


def resample(samples: torch.Tensor, orig_rate: int, new_rate: int) -> torch.Tensor:
    """``samples`` ([channels, n] float) from ``orig_rate`` to ``new_rate`` Hz."""
    if orig_rate == new_rate:
        return samples
    if orig_rate <= 0 or new_rate <= 0:
        raise ValueError(f"sample rates must be positive (got {orig_rate} -> {new_rate})")
    g = math.gcd(orig_rate, new_rate)
    orig, new = orig_rate // g, new_rate // g
    kernels, pad = _kernels(orig, new)
    channels, n = samples.shape
    padded = torch.nn.functional.pad(samples[:, None, :].float(), (pad, pad + orig))
    out = torch.nn.functional.conv1d(padded, kernels, stride=orig)  # [channels, new, periods]
    out = out.transpose(1, 2).reshape(channels, -1)
    return out[:, : resampled_length(n, orig_rate, new_rate)].contiguous()


def downmix(samples: torch.Tensor) -> torch.Tensor:
    """[channels, n] -> [1, n]: the mean of the channels."""
    return samples if samples.shape[0] == 1 else samples.mean(dim=0, keepdim=True)
