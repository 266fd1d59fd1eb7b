"""vLLM's sleep mode routes: /sleep, /wake_up, /is_sleeping."""
