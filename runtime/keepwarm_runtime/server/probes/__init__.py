"""Probes and scrapes: /health, /ping, /ready, /version, /metrics, /debug/stats."""
