"""Names of the expert layouts (weights.kernel_layout) and their check, torch-free so settings can
list them and EngineConfig can check one without importing torch."""

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
