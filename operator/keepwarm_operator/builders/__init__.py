"""Pure desired-state builders: custom resource in, Kubernetes manifests (plain dicts) out.

No API calls here; the handlers apply what these return with server-side apply.
"""
