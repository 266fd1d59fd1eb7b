"""The weights' serving layout, one home for the cache daemon and the engine alike.

What a checkpoint is (files.py: its shard files, raw headers, identities and config.json, read
without torch, so the cache key needs none; checkpoint.py: those headers validated into tensor
records), how it is served (serving_layout.py: dtype and expert merges; kernel_layout.py and
layouts.py: a MoE kernel's expert layout; quantization.py and fp8.py: FP8 formats and online
quantization, `Fp8Settings`), and filling
an arena from that plan (arena.py): the daemon's shared arena, or a client's private one when the
cache cannot serve it. The cache (keepwarm_runtime.cache) and the engine (keepwarm_runtime.engine)
both take the layout from here and never from each other, so a cache hit and a disk load give the
engine the same tensors. Nothing here imports the engine or the cache.
"""
