"""Real Kubernetes control plane for the integration tests (see cluster.py)."""
