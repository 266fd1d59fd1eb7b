"""The make-model architectures the engine is tested on, by attention discovery (unit) and by greedy
parity with transformers (integration): one list, so the two suites cannot drift apart."""

ENGINE_ARCHS = [
    "llama",
    "gemma",
    "gemma2",
    "gemma3",
    "deepseek_v3",
    "deepseek_v3_yarn",
    "opt",
    "qwen3_moe",
    "mistral",
    "qwen2",
    "qwen3",
]
