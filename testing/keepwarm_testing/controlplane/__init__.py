"""Real Kubernetes control plane for the integration tests and benchmarks (see cluster.py)."""
