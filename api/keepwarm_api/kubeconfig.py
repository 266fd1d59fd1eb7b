"""How keepwarm's programs find their cluster: the one loader the operator and the node agent share.

A kubeconfig file when one is named; without one, the pod's ServiceAccount (in a cluster), else
$KUBECONFIG or ~/.kube/config. The kubernetes client is imported when called: keepwarm_api itself
does not depend on it (the agent has it as the runtime's extra `kubernetes`, the operator always).
"""

from __future__ import annotations

from typing import Any


def client_configuration(kubeconfig: str | None = None) -> Any:
    """A fresh kubernetes.client.Configuration (not the client's global default)."""
    from kubernetes import client, config

    cfg = client.Configuration()
    if kubeconfig is None:
        try:
            config.load_incluster_config(client_configuration=cfg)
            return cfg
        except config.ConfigException:
            pass
    config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    return cfg
