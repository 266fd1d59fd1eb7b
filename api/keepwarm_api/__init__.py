"""The keepwarm.dev/v1alpha1 API, shared by the operator and the node agent (pydantic only, no torch,
no kubernetes client): the custom resources' models (the single source of the CRDs, see crdgen), where
model sources appear inside pods (paths), and the WeightCacheNode spec and status builders.
"""

from .common import API_VERSION, GROUP, VERSION

__all__ = ["API_VERSION", "GROUP", "VERSION"]
