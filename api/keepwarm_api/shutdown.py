"""How a runtime pod stops without failing a request: the timings the operator renders and the server keeps.

Kubernetes takes a deleted pod out of its Service's endpoints while the kubelet is already stopping it:
kube-proxies, gateways and other clients learn of it a moment later. So the runtime container's preStop
hook sleeps PRESTOP_SLEEP_S (the kubelet's own `sleep` action, nothing runs in the container) while the
pod keeps serving as before; only then does SIGTERM reach `keepwarm serve`, whose parent closes its
copy of the listening socket (a stray new connection is refused at once, and the client tries another
endpoint) and lets the worker finish the requests in flight for up to DRAIN_S. The pod's
terminationGracePeriodSeconds covers all of it with a margin on each side, so the kubelet's SIGKILL
never cuts a drain short.
"""

from __future__ import annotations

PRESTOP_SLEEP_S = 5  # the preStop sleep: the pod serves on while clients stop sending to it
DRAIN_S = 30  # after SIGTERM, requests in flight get this long to finish (uvicorn's graceful shutdown)
STOP_MARGIN_S = 5  # the parent SIGKILLs a worker still stopping this long after DRAIN_S
# preStop, the drain, the parent's margin, and one more before the kubelet's SIGKILL.
TERMINATION_GRACE_S = PRESTOP_SLEEP_S + DRAIN_S + 2 * STOP_MARGIN_S
