"""The inference engine: transformers models with keepwarm attention, a paged KV cache, continuous batching.

Modules, in the order data flows: config → loader (weights from the cache or disk) → attention (fused
into the model) → kv_cache/block_manager → scheduler → model_runner → sampler → llm_engine → llm.
"""
