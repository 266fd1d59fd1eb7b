"""The torch resampler soundfile output goes through: lengths, accuracy, aliasing, downmix."""

from __future__ import annotations

import math

import pytest
import torch

from keepwarm_runtime.audio.resample import downmix, resample, resampled_length

RATES = [8000, 16000, 22050, 44100, 48000]


def _sine(freq: float, rate: int, n: int) -> torch.Tensor:
    return torch.sin(2 * math.pi * freq * torch.arange(n, dtype=torch.float64) / rate).float()[None]


@pytest.mark.parametrize("orig", RATES)
@pytest.mark.parametrize("new", RATES)
@pytest.mark.parametrize("n", [1, 999, 16000])
def test_length_is_within_one_sample(orig: int, new: int, n: int) -> None:
    out = resample(torch.zeros(2, n), orig, new)
    assert out.shape[0] == 2
    assert abs(out.shape[1] - n * new / orig) <= 1
    assert out.shape[1] == resampled_length(n, orig, new)


@pytest.mark.parametrize(("orig", "new"), [(44100, 16000), (8000, 16000), (48000, 16000), (22050, 48000)])
def test_a_tone_below_both_nyquists_survives(orig: int, new: int) -> None:
    out = resample(_sine(440.0, orig, orig), orig, new)[0]
    expected = _sine(440.0, new, out.shape[0])[0]
    inner = slice(new // 50, -new // 50)
    assert (out[inner] - expected[inner]).abs().max() < 2e-3


def test_a_tone_above_the_new_nyquist_is_filtered_out() -> None:
    out = resample(_sine(12000.0, 48000, 48000), 48000, 16000)[0]
    assert out[400:-400].abs().max() < 0.02  # 12 kHz cannot exist at 16 kHz; it must not alias to 4 kHz


def test_same_rate_is_identity_and_bad_rates_refused() -> None:
    x = torch.randn(1, 100)
    assert resample(x, 16000, 16000) is x
    with pytest.raises(ValueError, match="positive"):
        resample(x, 0, 16000)


def test_downmix_is_the_channel_mean() -> None:
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    torch.testing.assert_close(downmix(x), torch.tensor([[0.5, 0.5]]))
    assert downmix(x[:1]) is not None and downmix(x[:1]).shape == (1, 2)
