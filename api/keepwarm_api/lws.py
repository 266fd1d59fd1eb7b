"""LeaderWorkerSet (sigs.k8s.io/lws, API v1): the names keepwarm reads and writes, in one home.

A group of tensor-parallel ranks over several pods (an InferenceDeployment's spec.parallelism.nodes)
runs as a LeaderWorkerSet: its controller creates each group's leader pod and worker pods, its pod
webhook gives every pod the leader's address and the pod's place in the group as environment
variables and labels, and its headless Service makes the leader's address resolve.
"""

from __future__ import annotations

GROUP = "leaderworkerset.x-k8s.io"
VERSION = "v1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "LeaderWorkerSet"
PLURAL = "leaderworkersets"
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"  # "0" on a group's leader
LEADER_ADDRESS_ENV = "LWS_LEADER_ADDRESS"  # the leader pod's DNS name, in every pod of its group
WORKER_INDEX_ENV = "LWS_WORKER_INDEX"  # the pod's place in its group: 0 for the leader
