"""Weight quantization formats the engine loads and produces (FP8 e4m3 with 128x128 block scales)."""
