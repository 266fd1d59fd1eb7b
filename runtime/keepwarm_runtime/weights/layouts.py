"""Names of the serving and expert layouts (weights.serving_layout, weights.kernel_layout), their check
and the cache key's ``conversion`` field, torch-free so settings can list them, EngineConfig can check
one and the cache daemon can key an arena without importing torch."""

from keepwarm_runtime.weights.tensor_parallel import WHOLE, Sharding

CONVERSION_ID = "serving-layout-v1"  # serving_layout's arena layout; bump when it changes

MODEL = "model"  # transformers' own fused experts
FLASHINFER_CUTLASS = "flashinfer_cutlass"  # gate_up with the up half first, as cutlass_fused_moe takes it
LAYOUT_IDS = {
    MODEL: "",
    FLASHINFER_CUTLASS: "flashinfer-cutlass-up-first-v1",
}  # cache key part; bump on change
LAYOUTS = tuple(LAYOUT_IDS)


class ExpertLayoutError(ValueError):
    """An expert layout that is unknown, or that a tensor cannot be converted to; says which and why."""


def check_layout(layout: str) -> str:
    if layout not in LAYOUT_IDS:
        raise ExpertLayoutError(f"expert layout {layout!r} is unknown; use one of {', '.join(LAYOUTS)}")
    return layout


def conversion_id(layout: str, sharding: Sharding = WHOLE) -> str:
    """The cache key's `conversion` field for arenas in `layout`: the serving layout, plus the kernel's,
    plus a tensor-parallel rank's slicing (weights.tensor_parallel; the key's tp_rank/tp_size say
    which slice)."""
    suffixes = [LAYOUT_IDS[check_layout(layout)], sharding.conversion_suffix()]
    return "+".join([CONVERSION_ID, *(s for s in suffixes if s)])
