"""Names of the expert layouts (engine.moe.kernel_layout), torch-free so settings can list them."""

MODEL = "model"  # transformers' own fused experts
FLASHINFER_CUTLASS = "flashinfer_cutlass"  # gate_up with the up half first, as cutlass_fused_moe takes it
LAYOUT_IDS = {
    MODEL: "",
    FLASHINFER_CUTLASS: "flashinfer-cutlass-up-first-v1",
}  # cache key part; bump on change
LAYOUTS = tuple(LAYOUT_IDS)
