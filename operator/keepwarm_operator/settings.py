"""The operator's settings, declared once (keepwarm_api.settings generates `keepwarm-operator run`'s
flags, KEEPWARM_OPERATOR_* variables, --help and the reference page's table from this class).

Parsed once by the CLI (a flag wins over its variable; an empty variable means the default), then
handed to kopf in its memo. Handlers read them from there, never from os.environ.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from keepwarm_api.settings import setting


@dataclass(frozen=True)
class OperatorSettings:
    ENV_PREFIX: ClassVar[str] = "KEEPWARM_OPERATOR_"

    agent_namespace: str = setting(
        "keepwarm-system", "namespace of agent DaemonSets and ServiceAccounts", env="KEEPWARM_AGENT_NAMESPACE"
    )
    namespaces: frozenset[str] = setting(
        frozenset(),
        "serve InferenceDeployments only here",
        flag="--namespace",
        metavar="NS",
        unset="all namespaces",
    )
    resync_seconds: float = setting(30.0, "period of the level-based resync timers")
    workers: int = setting(8, "kopf's thread pool for the (synchronous) handlers")
    kubeconfig: str | None = setting(None, "kubeconfig file", unset="in-cluster, then $KUBECONFIG")
    peering: str = setting("keepwarm", "ClusterKopfPeering name")
    standalone: bool = setting(False, "no peering: only for a single replica")
    priority: int | None = setting(None, "peering priority; replicas need distinct ones", unset="random")
    metrics_port: int = setting(8080, "/metrics port, 0 to disable")
    liveness_port: int = setting(8081, "/healthz port")
    log_level: str = setting("INFO", "DEBUG, INFO, WARNING or ERROR")
