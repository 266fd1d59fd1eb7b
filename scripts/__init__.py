"""Repository scripts; a package so that `scripts.gpucheck` never resolves to a stray `scripts` elsewhere."""
