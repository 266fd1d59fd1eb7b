"""The length a WAV or FLAC file declares in its own header, read without any backend.

libsndfile and FFmpeg both trust the file size over a WAV's ``data`` chunk size, so a truncated WAV
decodes "fine" to fewer samples; comparing against the declared length is how ``load_audio`` tells.
FLAC's STREAMINFO states its total sample count the same way. Other formats declare no exact length.
"""

from __future__ import annotations

import struct

_UNKNOWN_SIZES = (0, 0xFFFFFFFF)  # streaming writers leave the data size unset


def declared_duration(data: bytes) -> float | None:
    """Seconds the header of a WAV or FLAC file declares, or None (other formats, unset, unreadable)."""
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return _wav_duration(data)
    if data[:4] == b"fLaC":
        return _flac_duration(data)
    return None


def _wav_duration(data: bytes) -> float | None:
    pos, byte_rate, data_size = 12, None, None
    while pos + 8 <= len(data) and (byte_rate is None or data_size is None):
        chunk_id, size = data[pos : pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        if chunk_id == b"fmt " and pos + 16 <= len(data):
            byte_rate = struct.unpack_from("<I", data, pos + 16)[0]
        elif chunk_id == b"data":
            data_size = size
        pos += 8 + size + (size & 1)
    if not byte_rate or data_size is None or data_size in _UNKNOWN_SIZES:
        return None
    return data_size / byte_rate


def _flac_duration(data: bytes) -> float | None:
    # 'fLaC', a 4-byte block header, then STREAMINFO: rate(20 bits) channels(3) bps(5) total(36).
    if len(data) < 8 + 18 or data[4] & 0x7F != 0:
        return None
    packed = int.from_bytes(data[8 + 10 : 8 + 18], "big")
    rate, total = packed >> 44, packed & ((1 << 36) - 1)
    if rate == 0 or total == 0:
        return None
    return total / rate
