"""The runtime's probe endpoints, as the operator's probes name them and the server answers them.

`/ready?wait=S` long-polls: it answers as soon as the engine is ready, or after S seconds (at most
READY_WAIT_MAX_S) with 503. A startup probe that long-polls succeeds the moment the weights are in,
whatever its period; the kubelet then runs the readiness probe at once, so the pod is Ready within
one probe round trip of the runtime being ready instead of up to a period later.
"""

from __future__ import annotations

READY_PATH = "/ready"  # 200 once the engine is ready, 503 while loading
HEALTH_PATH = "/health"  # 200 while the process can serve (loading included), 503 once the engine failed
READY_WAIT_PARAM = "wait"  # query parameter of READY_PATH: seconds to hold the answer while loading
READY_WAIT_MAX_S = 30.0  # the longest a /ready request waits, whatever it asks


def ready_long_poll(wait_s: int) -> str:
    """The path of a /ready request that waits up to wait_s seconds for the engine."""
    return f"{READY_PATH}?{READY_WAIT_PARAM}={wait_s}"
