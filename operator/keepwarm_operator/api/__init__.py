"""The keepwarm.dev/v1alpha1 API: pydantic models, the single source of the CRDs (see crdgen)."""

from .common import API_VERSION, GROUP, VERSION

__all__ = ["API_VERSION", "GROUP", "VERSION"]
