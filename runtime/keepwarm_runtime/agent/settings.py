"""The node agent's own limits, declared once: the defaults of `keepwarm cache serve`'s agent flags
(cache/settings.py: ``--max-loads``, ``--stall-timeout``, ``--namespace``) and of NodeAgent's keywords.

No imports: the daemon's settings read these without loading the agent (or its kubernetes client).
"""

MAX_LOADS = 4  # downloads/loads in flight at once
STALL_TIMEOUT_S = 60.0  # a Hub download adding no bytes for this long is stopped (and retried later)
NAMESPACE = "default"  # where token Secrets are read when the pod's namespace is not given
