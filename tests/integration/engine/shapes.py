"""Model shapes the FP8 and MoE tests share."""

# Every quantized projection a multiple of 128 wide: whole 128x128 blocks everywhere, so transformers'
# dequantizer (which needs whole blocks) reads the same checkpoint, and the experts dominate the bytes
# (the FP8/bf16 memory ratio).
WHOLE_BLOCKS = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 32,
}
