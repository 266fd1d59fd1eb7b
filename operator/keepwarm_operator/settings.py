"""The operator's settings: parsed once by the CLI (flags, defaults from KEEPWARM_* variables), then
handed to kopf in its memo. Handlers read them from there, never from os.environ."""

from __future__ import annotations

from dataclasses import dataclass

# Environment variables that supply the flags' defaults (the chart passes flags instead).
ENV_AGENT_NAMESPACE = "KEEPWARM_AGENT_NAMESPACE"
ENV_RESYNC_SECONDS = "KEEPWARM_OPERATOR_RESYNC_SECONDS"
ENV_WORKERS = "KEEPWARM_OPERATOR_WORKERS"


@dataclass(frozen=True)
class OperatorSettings:
    agent_namespace: str = "keepwarm-system"  # where agent DaemonSets and ServiceAccounts live
    namespaces: frozenset[str] = frozenset()  # InferenceDeployments served only here (empty: all)
    resync_seconds: float = 30.0  # period of the level-based resync timers
    workers: int = 8  # kopf's thread pool for the (synchronous) handlers
    kubeconfig: str | None = None  # None: in-cluster, then $KUBECONFIG / ~/.kube/config
