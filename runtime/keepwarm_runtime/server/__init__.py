"""OpenAI-compatible HTTP server over the engine: `keepwarm serve` (cli.py), routes (app.py)."""
