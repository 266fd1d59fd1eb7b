"""The value sets the custom resources and the runtime share, each defined once (standard library only,
so the cache daemon and the engine import them without pydantic): the CRDs' enums are these classes,
and the runtime's flags, checks and defaults name their members.
"""

from __future__ import annotations

from enum import StrEnum


class DType(StrEnum):
    AUTO = "auto"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"


# What weights can be served in (every DType but auto): the engine's, the daemon's and make-model's.
SERVING_DTYPES: tuple[str, ...] = tuple(d.value for d in DType if d is not DType.AUTO)


class Quantization(StrEnum):
    NONE = "none"
    FP8 = "fp8"


class Tier(StrEnum):
    GPU = "gpu"
    HOST = "host"


class CacheMode(StrEnum):
    ZERO_COPY = "zero_copy"
    COPY = "copy"
