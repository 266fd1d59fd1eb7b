"""The GPU run, prepared on a CPU machine: `scripts/gpu-prepare`, `scripts/gpu-check [--dry-run]`.

manifest (what is carried, what the GPU image has) → prepare (wheels → one xz archive) → plan (steps
and time boxes) → dryrun (here: carry size, imports under the GPU image's package set, flags) or
runner (there: unpack, run, bundle results into $OUT).
"""
