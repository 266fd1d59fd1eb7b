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

# DeepSeek-V3's latent attention in whole blocks too: kv_a_proj_with_mqa writes kv_lora_rank +
# qk_rope_head_dim rows and kv_b_proj reads kv_lora_rank columns, so both must be multiples of 128
# (head_dim is the rope dim in DeepSeek-V3's config).
DEEPSEEK_WHOLE_BLOCKS = WHOLE_BLOCKS | {
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "q_lora_rank": 128,
    "kv_lora_rank": 128,
    "qk_rope_head_dim": 128,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    "head_dim": 128,
}
