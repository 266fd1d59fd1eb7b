"""Real Kubernetes nodes on this machine for the tests: containerd, runc, CNI, the kubelet, kube-proxy,
and the images they run, built from the repository's Dockerfile (see cluster.py)."""
