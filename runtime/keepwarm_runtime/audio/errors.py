"""The audio errors: what a client did wrong (``AudioError``, a ``ValueError``) vs what a backend lacks.

``AudioError`` and its subclasses reach the client as HTTP 400 (``AudioTooLarge``: 413). The other two
never leave ``load_audio``: they tell the ``auto`` chain to try the next backend.
"""

from __future__ import annotations


class AudioError(ValueError):
    """The audio itself is bad: corrupt, truncated, empty, or over a limit."""

    code = "invalid_audio"


class AudioTooLong(AudioError):
    """Longer than ``max_duration_s``, or more decoded bytes than ``max_decoded_bytes``."""

    code = "audio_too_long"


class AudioTooLarge(AudioError):
    """The encoded upload itself is over the server's byte limit (HTTP 413)."""

    code = "audio_too_large"


class EmptyAudio(AudioError):
    """Decodes to no samples at all."""

    code = "empty_audio"


class UnsupportedFormat(AudioError):
    """No usable backend can open this container or codec."""

    code = "unsupported_audio_format"


class BackendUnavailable(Exception):
    """The backend's package cannot be imported or its native libraries cannot be loaded."""


class UnsupportedContainer(Exception):
    """The backend cannot open this container format (not: the file is corrupt)."""
