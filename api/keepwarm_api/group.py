"""The API group and version, and the label on every object of one WeightCache (standard library only,
so that importing keepwarm_api costs nothing)."""

GROUP = "keepwarm.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
CACHE_LABEL = f"{GROUP}/weightcache"  # value: WeightCache name (agents, WeightCacheNodes, Leases)
