"""Helpers shared by the tests and the benchmarks (never imported by the product): a real Kubernetes
control plane with fake GPU nodes (controlplane/), the operator as a subprocess (operator.py), cache
daemon snapshots built by hand for the node agent (snapshots.py).
Ports come from keepwarm_runtime.server.launcher.free_port, the one definition."""
