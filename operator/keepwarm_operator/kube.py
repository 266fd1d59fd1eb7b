"""A thin dict-in, dict-out Kubernetes client: server-side apply, get, list, patch, delete.

The handlers speak plain manifests (what the builders return), so this wraps the kubernetes client's
raw REST layer instead of its generated model classes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kubernetes import client

FIELD_MANAGER = "keepwarm-operator"
STATUS_WRITE_TRIES = 3  # write_status: reads and recomputes after a conflict
LIST_PAGE = 500  # list: objects per page


class ApiError(Exception):
    """An API call failed; `status` is the HTTP code, `reason` the Status reason (e.g. NotFound)."""

    def __init__(self, status: int, reason: str, message: str):
        super().__init__(f"{status} {reason}: {message}")
        self.status, self.reason, self.message = status, reason, message


@dataclass(frozen=True)
class Resource:
    group: str  # "" for core
    version: str
    plural: str
    namespaced: bool

    def path(self, namespace: str | None = None, name: str | None = None, sub: str | None = None) -> str:
        base = f"/api/{self.version}" if not self.group else f"/apis/{self.group}/{self.version}"
        if self.namespaced and namespace:
            base += f"/namespaces/{namespace}"
        base += f"/{self.plural}"
        if name:
            base += f"/{name}"
        if sub:
            base += f"/{sub}"
        return base


RESOURCES = {
    ("v1", "ServiceAccount"): Resource("", "v1", "serviceaccounts", True),
    ("v1", "Service"): Resource("", "v1", "services", True),
    ("v1", "ConfigMap"): Resource("", "v1", "configmaps", True),
    ("v1", "Node"): Resource("", "v1", "nodes", False),
    ("v1", "Namespace"): Resource("", "v1", "namespaces", False),
    ("v1", "Pod"): Resource("", "v1", "pods", True),
    ("coordination.k8s.io/v1", "Lease"): Resource("coordination.k8s.io", "v1", "leases", True),
    ("apps/v1", "DaemonSet"): Resource("apps", "v1", "daemonsets", True),
    ("apps/v1", "Deployment"): Resource("apps", "v1", "deployments", True),
    ("rbac.authorization.k8s.io/v1", "ClusterRole"): Resource(
        "rbac.authorization.k8s.io", "v1", "clusterroles", False
    ),
    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"): Resource(
        "rbac.authorization.k8s.io", "v1", "clusterrolebindings", False
    ),
    ("rbac.authorization.k8s.io/v1", "Role"): Resource("rbac.authorization.k8s.io", "v1", "roles", True),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): Resource(
        "rbac.authorization.k8s.io", "v1", "rolebindings", True
    ),
    ("keepwarm.dev/v1alpha1", "WeightCache"): Resource("keepwarm.dev", "v1alpha1", "weightcaches", False),
    ("keepwarm.dev/v1alpha1", "WeightCacheNode"): Resource(
        "keepwarm.dev", "v1alpha1", "weightcachenodes", False
    ),
    ("keepwarm.dev/v1alpha1", "InferenceDeployment"): Resource(
        "keepwarm.dev", "v1alpha1", "inferencedeployments", True
    ),
}


def resource(api_version: str, kind: str) -> Resource:
    try:
        return RESOURCES[(api_version, kind)]
    except KeyError:
        raise ValueError(f"keepwarm's client does not know {kind} ({api_version})") from None


def connection_info(cfg: client.Configuration, settings: Any) -> Any:
    """kopf's credentials from a client Configuration (as kopf.login_via_client reads its global one)."""
    import kopf

    header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix("authorization")
    parts = header.split(" ", 1) if header else []
    scheme, token = (None, None) if not parts else (None, parts[0]) if len(parts) == 1 else tuple(parts)
    return kopf.ConnectionInfo(
        server=cfg.host,
        ca_path=cfg.ssl_ca_cert,
        insecure=not cfg.verify_ssl,
        username=cfg.username or None,
        password=cfg.password or None,
        scheme=scheme,
        token=token,
        certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file,
        trust_env=settings.networking.trust_env,
    )


class Kube:
    def __init__(self, api_client: client.ApiClient, field_manager: str = FIELD_MANAGER):
        self.api = api_client
        self.field_manager = field_manager

    def request(
        self, method: str, path: str, query: list[tuple[str, str]] | None = None, body: Any = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:  # fmt: skip
        headers = {"Accept": "application/json", "Content-Type": content_type}
        method, url, headers, body, post = self.api.param_serialize(
            method,
            path,
            query_params=query or [],
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        try:
            response = self.api.call_api(method, url, header_params=headers, body=body, post_params=post)
            response.read()
        except client.ApiException as exc:
            return self._raise(exc.status, exc.body)
        if response.status >= 400:
            return self._raise(response.status, response.data)
        return json.loads(response.data) if response.data else {}

    @staticmethod
    def _raise(status: int, data: bytes | str | None) -> dict[str, Any]:
        try:
            payload = json.loads(data or "{}")
        except ValueError:
            payload = {"message": str(data)}
        raise ApiError(status, payload.get("reason", ""), payload.get("message", ""))

    def apply(
        self, obj: dict[str, Any], *, status: bool = False, manager: str | None = None
    ) -> dict[str, Any]:
        """Server-side apply (force: the operator owns the fields it declares)."""
        res = resource(obj["apiVersion"], obj["kind"])
        meta = obj["metadata"]
        path = res.path(meta.get("namespace"), meta["name"], "status" if status else None)
        query = [("fieldManager", manager or self.field_manager), ("force", "true")]
        return self.request("PATCH", path, query, obj, "application/apply-patch+yaml")

    def get(
        self, api_version: str, kind: str, name: str, namespace: str | None = None
    ) -> dict[str, Any] | None:
        try:
            return self.request("GET", resource(api_version, kind).path(namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def list(
        self, api_version: str, kind: str, namespace: str | None = None, labels: str | None = None,
        fields: str | None = None,
    ) -> list[dict[str, Any]]:  # fmt: skip
        """Every matching object, LIST_PAGE at a time (large clusters: no single huge response)."""
        query = [("limit", str(LIST_PAGE))]
        if labels:
            query.append(("labelSelector", labels))
        if fields:
            query.append(("fieldSelector", fields))
        path, found, token = resource(api_version, kind).path(namespace), [], ""
        while True:
            page = self.request("GET", path, query + ([("continue", token)] if token else []))
            found.extend(page.get("items", []))
            token = (page.get("metadata") or {}).get("continue") or ""
            if not token:
                return found

    def merge_patch(
        self, api_version: str, kind: str, name: str, patch: dict[str, Any], namespace: str | None = None,
        status: bool = False,
    ) -> dict[str, Any]:  # fmt: skip
        path = resource(api_version, kind).path(namespace, name, "status" if status else None)
        return self.request("PATCH", path, None, patch, "application/merge-patch+json")

    def write_status(
        self, api_version: str, kind: str, name: str, namespace: str | None,
        compute: Callable[[dict[str, Any]], dict[str, Any] | None], body: dict[str, Any] | None = None,
    ) -> bool:  # fmt: skip
        """Merge-patch compute(body) as the status, with the body's resourceVersion as a precondition.

        A 409 means someone wrote the object after we read it: read it again and recompute (up to
        STATUS_WRITE_TRIES), so a status computed from a stale read never lands over a fresher one.
        compute returns None when nothing needs writing. False when the object is gone or never settled.
        """
        for _ in range(STATUS_WRITE_TRIES):
            body = body or self.get(api_version, kind, name, namespace)
            if body is None or body["metadata"].get("deletionTimestamp"):
                return False
            status = compute(body)
            if status is None:
                return True
            patch = {"metadata": {"resourceVersion": body["metadata"]["resourceVersion"]}, "status": status}
            try:
                self.merge_patch(api_version, kind, name, patch, namespace, status=True)
                return True
            except ApiError as exc:
                if exc.status != 409:
                    raise
                body = None
        return False

    def delete(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> bool:
        try:
            self.request("DELETE", resource(api_version, kind).path(namespace, name))
            return True
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
