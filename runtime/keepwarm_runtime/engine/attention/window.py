"""Which keys a query may see: the attention call's window, and the window transformers' cache adds.

transformers applies a sliding window in two places. The attention call's mask (and its `sliding_window=`
argument) limits every query. Separately, `generate()`'s `DynamicCache` keeps only the last
`sliding_window - 1` tokens of a layer whose config says it slides, between forward passes. A model
whose attention call passes no window (Moshi) therefore attends over the whole prompt during prefill,
but each generated token sees only the last `sliding_window` positions. keepwarm reproduces both:
prompt positions use the call's window, generated positions the narrower of the two. Tying the rule
to prompt positions, not to forward passes, keeps it independent of chunking, prefix hits and
recompute after preemption.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Window:
    prompt: int | None  # window for queries at prompt positions (None: all earlier keys)
    generated: int | None  # window for queries at generated positions

    @property
    def uniform(self) -> bool:
        """The same window for every query (a FlashInfer `window_left` can express it)."""
        return self.prompt == self.generated


def narrower(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)


def effective_window(call_window: int | None, cache_window: int | None) -> Window:
    """The call's window applies everywhere; the cache's only to generated positions."""
    return Window(call_window, narrower(call_window, cache_window))


def cache_windows(text_config, num_layers: int) -> list[int | None]:
    """Per layer index, the window generate()'s DynamicCache applies between passes (None: keeps all).
    Built with transformers' own DynamicCache, so keepwarm follows whatever it decides."""
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=text_config)
    except (TypeError, ValueError, AttributeError):  # configs DynamicCache cannot read keep everything
        return [None] * num_layers
    layers = getattr(cache, "layers", [])
    windows: list[int | None] = []
    for i in range(num_layers):
        layer = layers[i] if i < len(layers) else None  # past the end: DynamicCache adds full layers
        sliding = getattr(layer, "is_sliding", False) and getattr(layer, "sliding_window", None)
        windows.append(int(sliding) if sliding else None)
    return windows
