"""keepwarm's one Kubernetes client, shared by the operator and the node agent: dict-in, dict-out
server-side apply, get, list, patch, delete and watch.

Both sides speak plain manifests (what the operator's builders return, the JSON the agent reads and
patches), so this wraps the kubernetes client's raw REST layer (its ApiClient: the kubeconfig or
in-cluster credentials from keepwarm_api.kubeconfig, token refresh, connection pool) instead of its
generated model classes. The kubernetes client is imported when a client is made or a call fails:
keepwarm_api itself does not depend on it (the operator always has it, the agent as the runtime's
extra `kubernetes`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from . import lws

OPERATOR_FIELD_MANAGER = "keepwarm-operator"
AGENT_FIELD_MANAGER = "keepwarm-agent"
STATUS_WRITE_TRIES = 3  # write_status: reads and recomputes after a conflict
LIST_PAGE = 500  # list: objects per page
WATCH_TIMEOUT_S = 300  # watch: the API server ends each watch after this (timeoutSeconds)
WATCH_READ_SLACK_S = 30  # watch: a stream silent this long past its timeout is dead (read timeout)
WATCH_CONNECT_S = 30  # watch: connect timeout
GONE = 410  # a watch's resourceVersion is too old: list again


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
    ("v1", "Secret"): Resource("", "v1", "secrets", True),
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
    (lws.API_VERSION, lws.KIND): Resource(lws.GROUP, lws.VERSION, lws.PLURAL, True),
}


def resource(api_version: str, kind: str) -> Resource:
    try:
        return RESOURCES[(api_version, kind)]
    except KeyError:
        raise ValueError(f"keepwarm's client does not know {kind} ({api_version})") from None


def connect(kubeconfig: str | None = None, field_manager: str = OPERATOR_FIELD_MANAGER,
            pool_size: int = 0) -> Kube:  # fmt: skip
    """A client with keepwarm's one loader (keepwarm_api.kubeconfig); pool_size: connections kept
    at least (one per thread that may call at once, else each burst pays TLS handshakes)."""
    from kubernetes import client

    from .kubeconfig import client_configuration

    cfg = client_configuration(kubeconfig)
    cfg.connection_pool_maxsize = max(cfg.connection_pool_maxsize or 0, pool_size)
    return Kube(client.ApiClient(cfg), field_manager)


@dataclass(frozen=True)
class Listing:
    items: list[dict[str, Any]]
    resource_version: str  # the list's snapshot: a watch from here misses nothing and repeats nothing


class Kube:
    """Thread-safe as its ApiClient is: one per process, shared by every thread that calls."""

    def __init__(self, api_client: Any, field_manager: str = OPERATOR_FIELD_MANAGER):
        self.api = api_client  # a kubernetes.client.ApiClient
        self.field_manager = field_manager

    def send(
        self, method: str, path: str, query: list[tuple[str, str]] | None = None, body: Any = None,
        content_type: str = "application/json", timeout: tuple[float, float] | None = None,
    ) -> Any:  # fmt: skip
        """The response (a kubernetes.client.rest.RESTResponse), its body not yet read; ApiError for
        any HTTP error."""
        from kubernetes.client import ApiException

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
            response = self.api.call_api(
                method, url, header_params=headers, body=body, post_params=post, _request_timeout=timeout
            )
        except ApiException as exc:
            raise api_error(exc.status, exc.body) from None
        if response.status >= 400:
            raise api_error(response.status, response.read())
        return response

    def request(
        self, method: str, path: str, query: list[tuple[str, str]] | None = None, body: Any = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:  # fmt: skip
        data = self.send(method, path, query, body, content_type).read()
        return json.loads(data) if data else {}

    def apply(
        self, obj: dict[str, Any], *, status: bool = False, manager: str | None = None
    ) -> dict[str, Any]:
        """Server-side apply (force: this field manager owns the fields it declares)."""
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
        return self.listing(api_version, kind, namespace, labels, fields).items

    def listing(
        self, api_version: str, kind: str, namespace: str | None = None, labels: str | None = None,
        fields: str | None = None,
    ) -> Listing:  # fmt: skip
        """Every matching object, LIST_PAGE at a time (large clusters: no single huge response),
        and the list's resourceVersion (every page is of the first one's snapshot)."""
        query = [("limit", str(LIST_PAGE)), *selectors(labels, fields)]
        path, found, token = resource(api_version, kind).path(namespace), [], ""
        while True:
            page = self.request("GET", path, query + ([("continue", token)] if token else []))
            found.extend(page.get("items", []))
            meta = page.get("metadata") or {}
            token = meta.get("continue") or ""
            if not token:
                return Listing(found, meta.get("resourceVersion", ""))

    def watch(
        self, api_version: str, kind: str, resource_version: str, namespace: str | None = None,
        labels: str | None = None, fields: str | None = None, timeout_s: int = WATCH_TIMEOUT_S,
        bookmarks: bool = False,
    ) -> Iterator[tuple[str, dict[str, Any]]]:  # fmt: skip
        """The changes after resource_version (a listing's), as (type, object), until the API server
        ends the stream after timeout_s: ADDED, MODIFIED, DELETED, and BOOKMARK (an object with only
        a newer resourceVersion) when bookmarks are asked for. An ERROR event raises its ApiError:
        410 Gone (GONE) says that version is too old, list again."""
        query = [("watch", "true"), ("resourceVersion", resource_version), *selectors(labels, fields)]
        query += [("timeoutSeconds", str(timeout_s))]
        if bookmarks:
            query.append(("allowWatchBookmarks", "true"))
        path = resource(api_version, kind).path(namespace)
        read_timeout = (WATCH_CONNECT_S, timeout_s + WATCH_READ_SLACK_S)
        stream = self.send("GET", path, query, timeout=read_timeout).response  # urllib3, unread
        try:
            for line in stream:
                if not line.strip():
                    continue
                event = json.loads(line)
                if event["type"] == "ERROR":
                    status = event.get("object") or {}
                    raise ApiError(
                        status.get("code", 500), status.get("reason", ""), status.get("message", "")
                    )
                yield event["type"], event["object"]
        finally:  # as the kubernetes client's own watch: a stream left early is not reused
            stream.close()
            stream.release_conn()

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


def selectors(labels: str | None, fields: str | None) -> list[tuple[str, str]]:
    """The query parameters of a label and a field selector (either may be absent)."""
    return [(k, v) for k, v in (("labelSelector", labels), ("fieldSelector", fields)) if v]


def api_error(status: int, data: bytes | str | None) -> ApiError:
    """The ApiError of an HTTP error response (its body a Status, or any text)."""
    try:
        payload = json.loads(data or "{}")
    except ValueError:
        payload = {"message": str(data)}
    if not isinstance(payload, dict):
        payload = {"message": str(data)}
    return ApiError(status, payload.get("reason", ""), payload.get("message", ""))
