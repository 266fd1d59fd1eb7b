"""The API group and version (standard library only, so that importing keepwarm_api costs nothing)."""

GROUP = "keepwarm.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
