"""The keepwarm.dev/v1alpha1 API, shared by the operator and the node agent (it depends on pydantic only:
no torch, no kubernetes client): the custom resources' models (the single source of the CRDs, see
crdgen), where model sources appear inside pods (paths), and the WeightCacheNode spec and status
builders; also the settings layer every keepwarm program declares its flags and KEEPWARM_* variables
with (settings) and the variables the operator sets on pods (podenv), and the value sets both sides
share (values: dtype names, quantizations, tiers, cache modes). Importing the package itself needs no
pydantic: settings, podenv and values are standard library only, so the runtime's core uses them on
machines without it. The operator's and the agent's one Kubernetes client (kube) and its credentials
(kubeconfig) import the kubernetes client only when called: the package does not depend on it.
"""

from .group import API_VERSION, GROUP, VERSION

__all__ = ["API_VERSION", "GROUP", "VERSION"]
