"""keepwarm_api.kube, the operator's and the agent's one client, against a scripted HTTP server: the
real client (kubeconfig loader, the kubernetes ApiClient underneath) over real sockets, so paging,
the watch stream, API errors and the agent's list+watch loop are checked on the wire."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import pytest

from keepwarm_api import API_VERSION
from keepwarm_api.kube import AGENT_FIELD_MANAGER, GONE, ApiError, Kube, connect
from keepwarm_api.weightcachenode import KIND as NODE_KIND

NODES = "/apis/keepwarm.dev/v1alpha1/weightcachenodes"
Reply = tuple[int, list[dict]]  # HTTP status, JSON documents (one body, or a watch's event lines)


class Scripted(ThreadingHTTPServer):
    """Answers each request with the next reply of its script and records what was asked."""

    daemon_threads = True

    def __init__(self, script: list[Reply]):
        super().__init__(("127.0.0.1", 0), Handler)
        self.script, self.asked = list(script), []
        self.done = threading.Event()  # the script ran out


class Handler(BaseHTTPRequestHandler):
    server: Scripted

    def _answer(self) -> None:
        url = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        query = dict(parse_qsl(url.query))
        self.server.asked.append((self.command, url.path, query, self.headers.get("Content-Type"), body))
        if self.server.script:
            status, docs = self.server.script.pop(0)
        else:
            self.server.done.set()
            status, docs = 200, [] if "watch" in query else [listing([], "99")]
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.end_headers()  # HTTP/1.0: the body ends when the connection closes, as a watch's does
        self.wfile.write(b"".join(json.dumps(doc).encode() + b"\n" for doc in docs))

    do_GET = do_PATCH = do_DELETE = _answer

    def log_message(self, *args: object) -> None:
        pass


def listing(items: list[dict], version: str, token: str = "") -> dict:
    meta = {"resourceVersion": version, **({"continue": token} if token else {})}
    return {"kind": "WeightCacheNodeList", "metadata": meta, "items": items}


def node(name: str, version: str, message: str = "") -> dict:
    meta = {"name": name, "resourceVersion": version, "uid": f"uid-{name}", "generation": 1}
    return {"apiVersion": API_VERSION, "kind": NODE_KIND, "metadata": meta, "status": {"message": message}}


def status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "status": "Failure", "code": code, "reason": reason, "message": message}


@pytest.fixture
def serve(tmp_path: Path) -> Iterator:
    """serve(script) -> (server, Kube as the agent connects); the kubeconfig names a bearer token."""
    servers: list[Scripted] = []

    def start(script: list[Reply]) -> tuple[Scripted, Kube]:
        server = Scripted(script)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        kubeconfig = tmp_path / f"kc{len(servers)}.yaml"
        kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: x\n"
            f"clusters: [{{name: c, cluster: {{server: 'http://127.0.0.1:{server.server_address[1]}'}}}}]\n"
            "users: [{name: u, user: {token: abc123}}]\n"
            "contexts: [{name: x, context: {cluster: c, user: u}}]\n"
        )
        return server, connect(str(kubeconfig), AGENT_FIELD_MANAGER)

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_a_listing_follows_continue_tokens_and_keeps_the_snapshot_version(serve):
    server, kube = serve(
        [(200, [listing([node("a", "3")], "7", "next")]), (200, [listing([node("b", "4")], "7")])]
    )
    found = kube.listing(API_VERSION, NODE_KIND, fields="metadata.name=a")
    assert [o["metadata"]["name"] for o in found.items] == ["a", "b"] and found.resource_version == "7"
    (_, path, first, _, _), (_, _, second, _, _) = server.asked
    assert path == NODES and first == {"limit": "500", "fieldSelector": "metadata.name=a"}
    assert second == {**first, "continue": "next"}


def test_a_watch_yields_events_from_its_version_and_raises_gone(serve):
    events = [
        {"type": "ADDED", "object": node("a", "8")},
        {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "9"}}},
        {"type": "DELETED", "object": node("a", "10")},
    ]
    expired = {"type": "ERROR", "object": status(GONE, "Expired", "too old resource version: 1 (10)")}
    server, kube = serve([(200, events), (200, [events[0], expired])])
    seen = [
        (kind, obj["metadata"]["resourceVersion"]) for kind, obj in kube.watch(API_VERSION, NODE_KIND, "7")
    ]
    assert seen == [("ADDED", "8"), ("BOOKMARK", "9"), ("DELETED", "10")]  # until the server ended it
    _, path, query, _, _ = server.asked[0]
    assert path == NODES and query == {"watch": "true", "resourceVersion": "7", "timeoutSeconds": "300"}
    stream = kube.watch(API_VERSION, NODE_KIND, "1", fields="metadata.name=a", bookmarks=True)
    assert next(stream)[0] == "ADDED"
    with pytest.raises(ApiError) as gone:
        next(stream)
    assert (gone.value.status, gone.value.reason) == (GONE, "Expired")
    assert server.asked[1][2]["allowWatchBookmarks"] == "true"


def test_api_errors_carry_the_status_and_a_missing_object_is_none(serve):
    server, kube = serve(
        [
            (404, [status(404, "NotFound", 'secrets "hf" not found')]),
            (403, [status(403, "Forbidden", "secrets is forbidden")]),
            (409, [status(409, "Conflict", "the object has been modified")]),
        ]
    )
    assert kube.get("v1", "Secret", "hf", "ns") is None
    with pytest.raises(ApiError) as forbidden:
        kube.get("v1", "Secret", "hf", "ns")
    assert (forbidden.value.status, forbidden.value.reason) == (403, "Forbidden")
    with pytest.raises(ApiError) as conflict:
        kube.merge_patch(API_VERSION, NODE_KIND, "a", {"status": {}}, status=True)
    assert conflict.value.status == 409
    assert [a[1] for a in server.asked] == ["/api/v1/namespaces/ns/secrets/hf"] * 2 + [f"{NODES}/a/status"]
    assert server.asked[2][3] == "application/merge-patch+json"


def test_apply_is_a_forced_server_side_apply_by_its_field_manager(serve):
    server, kube = serve([(200, [node("a", "2")]), (200, [node("a", "3")])])
    lease = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "l", "namespace": "ns"},
    }
    kube.apply(lease)
    kube.apply(lease, manager="e2e")
    (method, path, query, content, body), (_, _, other, _, _) = server.asked
    assert (method, path, content) == (
        "PATCH",
        "/apis/coordination.k8s.io/v1/namespaces/ns/leases/l",
        "application/apply-patch+yaml",
    )
    assert query == {"fieldManager": AGENT_FIELD_MANAGER, "force": "true"} and body == lease
    assert other["fieldManager"] == "e2e"


def test_the_agent_lists_then_watches_and_lists_again_when_a_watch_ends_or_expires(serve):
    """The node agent's watch of its WeightCacheNode: a list by name, a watch from the list's version;
    a watch the server ended and one that answered 410 Gone are each followed by a fresh list."""
    from keepwarm_runtime.agent.kubernetes import NodeAgent

    name = "wc.node-1"
    expired = {"type": "ERROR", "object": status(GONE, "Expired", "too old")}
    script = [
        (200, [listing([node(name, "5", "one")], "5")]),
        (200, [{"type": "MODIFIED", "object": node(name, "6", "two")}]),  # then the server's timeout
        (200, [listing([node(name, "6", "two")], "12")]),
        (200, [expired]),
        (200, [listing([node(name, "14", "three")], "14")]),
    ]
    server, kube = serve(script)
    agent = NodeAgent([], "wc", "node-1", kube)
    seen: list[str] = []
    agent._follow = lambda obj: seen.append(obj["status"]["message"] if obj else "gone")  # type: ignore[method-assign]
    stop = threading.Event()
    thread = threading.Thread(target=agent.run_watch, args=(stop,), daemon=True)
    thread.start()
    assert server.done.wait(10)
    stop.set()
    thread.join(10)
    calls = [
        ("watch" if "watch" in q else "list", q.get("resourceVersion")) for _, _, q, _, _ in server.asked
    ]
    assert calls[:6] == [
        ("list", None), ("watch", "5"), ("list", None), ("watch", "12"), ("list", None), ("watch", "14")
    ]  # fmt: skip
    assert all(q["fieldSelector"] == f"metadata.name={name}" for _, _, q, _, _ in server.asked)
    assert seen[:4] == ["one", "two", "two", "three"]
