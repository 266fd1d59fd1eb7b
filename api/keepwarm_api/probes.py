"""The runtime's probe endpoints, as the operator's probes name them and the server answers them.

`/ready?wait=S` long-polls: it answers as soon as the engine is ready, or after S seconds (at most
READY_WAIT_MAX_S) with 503. A readiness probe that long-polls for its whole period always has an
attempt waiting while a pod loads, so the kubelet marks the pod Ready within a round trip of the
runtime being ready, whatever the period. (A startup probe would not: the kubelet runs the readiness
probe after a startup probe's success only at its next sync of the pod, which waits for its next relist
of the containers, up to a second later: kubelet v1.37 pod_workers.go, `podCache.GetNewerThan`.)
"""

from __future__ import annotations

READY_PATH = "/ready"  # 200 once the engine is ready, 503 while loading
HEALTH_PATH = "/health"  # 200 while the process can serve (loading included), 503 once the engine failed
READY_WAIT_PARAM = "wait"  # query parameter of READY_PATH: seconds to hold the answer while loading
READY_WAIT_MAX_S = 30.0  # the longest a /ready request waits, whatever it asks


def ready_long_poll(wait_s: int) -> str:
    """The path of a /ready request that waits up to wait_s seconds for the engine."""
    return f"{READY_PATH}?{READY_WAIT_PARAM}={wait_s}"
