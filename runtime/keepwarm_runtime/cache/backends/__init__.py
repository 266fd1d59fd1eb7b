"""Memory tiers of the cache: ``host`` (memfd arenas) and ``gpu`` (CUDA VMM allocations)."""
