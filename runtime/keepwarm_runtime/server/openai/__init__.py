"""The OpenAI-compatible route groups (and vLLM's extras), one folder each."""
