"""A Hugging Face Hub on loopback for tests: olah serving local git repositories, behind a token gate.

olah (PyPI, a Hub mirror) with `offline = true` and `mirrors-path` serves the git repositories it finds
at <mirrors>/models/<org>/<name> through the Hub's own endpoints (model info by revision, resolve,
paths-info), so huggingface_hub's snapshot_download runs unmodified against it through HF_ENDPOINT:
branches resolve to their commit (refs/<branch> in the client's cache), a commit sha pins one.

olah does not check tokens (a mirror passes them upstream), so a small gate in front of it answers 401
for a gated repository unless the request carries its bearer token, as the Hub does for gated or
private repositories; every other request is forwarded unchanged. The gate records what it saw.
stop() ends both processes' listeners (clients get connection refused, as in an outage); start()
brings them back on the same ports.
"""

from __future__ import annotations

import http.client
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from keepwarm_runtime.server.launcher import free_port

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "host"}
START_TIMEOUT_S = 60.0


class HubStartError(RuntimeError):
    """olah did not answer on its port in time (its log's tail is the message)."""


@dataclass(frozen=True)
class SeenRequest:
    method: str
    path: str
    authorization: str | None
    status: int


def git(repo: Path, *args: str) -> str:
    """Run git in repo with a fixed identity (no global config needed); its stdout, stripped."""
    cmd = ["git", "-c", "user.name=keepwarm-tests", "-c", "user.email=tests@keepwarm.invalid", *args]
    return subprocess.run(cmd, cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


class _Gate(BaseHTTPRequestHandler):
    """Forward to olah; 401 for a gated repository without its token. Redirects olah answers with
    point back at the gate, so clients never go around it (nor need to reach olah's loopback port)."""

    hub: LocalHub  # set on the per-hub subclass

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self._handle()

    def do_HEAD(self) -> None:
        self._handle()

    def _handle(self) -> None:
        auth = self.headers.get("Authorization")
        needed = self.hub.token_for(self.path)
        if needed is not None and auth != f"Bearer {needed}":
            body = b'{"error": "Access to this repository is restricted: pass a token"}'
            self._record(auth, 401)
            self.send_response(401)
            self.send_header("Content-Type", "application/json")
            self.send_header("X-Error-Code", "GatedRepo")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
            return
        upstream = http.client.HTTPConnection("127.0.0.1", self.hub.olah_port, timeout=60)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        upstream.request(self.command, self.path, headers=headers)
        resp = upstream.getresponse()
        body = resp.read()  # dechunked; the models served here are small
        upstream.close()
        self._record(auth, resp.status)
        self.send_response(resp.status)
        olah = f"http://127.0.0.1:{self.hub.olah_port}"
        for key, value in resp.getheaders():
            if key.lower() == "location":  # olah's redirects (a trailing slash) name its own port
                value = value.replace(olah, self.hub.endpoint)
            if key.lower() not in HOP_BY_HOP and key.lower() != "content-length":
                self.send_header(key, value)
        length = resp.getheader("Content-Length") if self.command == "HEAD" else None
        self.send_header("Content-Length", length or str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _record(self, auth: str | None, status: int) -> None:
        with self.hub.lock:
            self.hub.seen.append(SeenRequest(self.command, self.path, auth, status))


class LocalHub:
    """Model repositories as git repositories, served by olah behind the token gate on loopback."""

    def __init__(self, workdir: Path, host: str = "127.0.0.1") -> None:
        self.workdir = workdir
        self.host = host  # the gate's address: loopback, or the pod bridge's for agents in pods
        self.mirrors = workdir / "mirrors"
        self.port, self.olah_port = free_port(), free_port()
        self.gated: dict[str, str] = {}  # repo id -> the token it needs
        self.seen: list[SeenRequest] = []
        self.lock = threading.Lock()
        self._olah: subprocess.Popen[bytes] | None = None
        self._gate: ThreadingHTTPServer | None = None

    @property
    def endpoint(self) -> str:
        """HF_ENDPOINT for clients."""
        return f"http://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._gate is not None

    def repo_dir(self, repo: str) -> Path:
        org, name = repo.split("/")
        return self.mirrors / "models" / org / name

    def add_repo(self, repo: str, files: Path) -> str:
        """A new repository holding a copy of the directory files on branch main; its commit sha."""
        path = self.repo_dir(repo)
        shutil.copytree(files, path)
        git(path, "init", "-q", "-b", "main")
        git(path, "add", "-A")
        git(path, "commit", "-q", "-m", f"{repo}: first commit")
        return git(path, "rev-parse", "HEAD")

    def commit(self, repo: str, files: dict[str, bytes], branch: str = "main") -> str:
        """Write files on branch (created from main's head if new) and commit; the new sha."""
        path = self.repo_dir(repo)
        existing = git(path, "branch", "--list", branch)
        git(path, "checkout", "-q", *([] if existing else ["-b"]), branch)
        for name, data in files.items():
            (path / name).write_bytes(data)
        git(path, "add", "-A")
        git(path, "commit", "-q", "-m", f"{repo}: change on {branch}")
        sha = git(path, "rev-parse", "HEAD")
        git(path, "checkout", "-q", "main")
        return sha

    def gate(self, repo: str, token: str) -> None:
        """From now on, requests for repo need `Authorization: Bearer <token>`."""
        self.gated[repo] = token

    def token_for(self, path: str) -> str | None:
        """The token a request path needs (None: open), by the repository id it names."""
        return next((t for repo, t in self.gated.items() if f"/{repo}/" in f"{path.split('?')[0]}/"), None)

    def _config(self) -> Path:
        config = self.workdir / "olah.toml"
        netloc = f"{self.host}:{self.port}"  # URLs olah writes point at the gate, never around it
        config.write_text(
            "[basic]\n"
            f'host = "127.0.0.1"\nport = {self.olah_port}\n'
            f'repos-path = "{self.workdir / "olah-repos"}"\n'
            f'mirrors-path = ["{self.mirrors}"]\n'
            f'mirror-netloc = "{netloc}"\nmirror-lfs-netloc = "{netloc}"\n'
            "[accessibility]\noffline = true\n"
        )
        return config

    def start(self) -> LocalHub:
        log = open(self.workdir / "olah.log", "ab")  # noqa: SIM115 (the child holds it open)
        cmd = [sys.executable, "-m", "olah.server", "-c", str(self._config())]
        cmd += ["--log-path", str(self.workdir / "olah-logs")]
        self._olah = subprocess.Popen(cmd, cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self._wait_for_olah()
        handler = type("Gate", (_Gate,), {"hub": self})
        self._gate = ThreadingHTTPServer((self.host, self.port), handler)
        self._gate.daemon_threads = True
        threading.Thread(target=self._gate.serve_forever, daemon=True, name="hub-gate").start()
        return self

    def _wait_for_olah(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self._olah is not None
            if self._olah.poll() is not None:
                break
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.olah_port, timeout=2)
                conn.request("GET", "/")
                conn.getresponse().read()
                conn.close()
                return
            except OSError:
                time.sleep(0.2)
        self.stop()
        tail = (self.workdir / "olah.log").read_text(errors="replace")[-2000:]
        raise HubStartError(f"olah did not answer on 127.0.0.1:{self.olah_port}:\n{tail}")

    def stop(self) -> None:
        """Both listeners gone: clients see connection refused until start()."""
        if self._gate is not None:
            self._gate.shutdown()
            self._gate.server_close()
            self._gate = None
        if self._olah is not None:
            self._olah.terminate()
            try:
                self._olah.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._olah.kill()
                self._olah.wait()
            self._olah = None

    def requests_for(self, repo: str) -> list[SeenRequest]:
        with self.lock:
            return [r for r in self.seen if f"/{repo}/" in f"{r.path.split('?')[0]}/"]
