"""The supervising parent of `keepwarm serve`: fork the serving worker, watch it, fork a fresh one.

Python, not the weights, bounds a restart: importing torch, transformers and the server costs seconds
while a warm node cache hands the weights over in a fraction of one. So the parent pays the imports
once, holds the listening socket (bound by `keepwarm serve` as it started: listener.py), and forks
workers that inherit both; a worker attaches the weights, allocates its KV cache, warms up and serves
on the inherited socket. The parent never runs a torch
op, never touches CUDA and starts no thread before forking (a fork of a process whose OpenMP or CUDA
state is live is unsafe): it is one thread with a select loop.

The parent restarts the worker when it dies (cause ``crash``), when its /health goes unanswered for
``health_timeout`` seconds (``hang``: the worker is killed first) or answers 503 (``unhealthy``: the
engine failed); /health is asked by a non-blocking probe (server/worker_probe.py), so the loop never
waits on a worker. A worker says over a pipe when it starts accepting (``notify_serving``): silence
counts from then; one that has not served ``load_timeout`` seconds after its fork (a load stuck on a
read that never returns) is a hang too, which is how a pod's startupTimeoutSeconds is kept. While a
worker is replaced the listening socket stays open in the parent, so new connections wait in its
backlog instead of being refused; requests in flight in the dead worker end
with an error. The first restart in a row is immediate, later ones back off exponentially; a worker
that stays ready for ``STABLE_S`` ends the row. The parent's own /health (a port of its own) answers
200 while it can still recover and 503 once ``max_failed_restarts`` restarts in a row failed, so
Kubernetes' liveness probe restarts the container only then. Restarts are counted by cause; the
counts live in the parent, and each worker inherits them by the fork and exports them on /metrics.

A tensor-parallel engine (``ranks`` > 1) runs as a group: the parent forks rank 0 (the worker that
serves HTTP and drives the engine) and ranks 1..N-1 (which follow its steps: engine/parallel), each
called with its rank and the group's rendezvous, a fresh one per start. The group lives and restarts
as a whole: any rank that dies takes the others down (killed here), and the group is forked again
(cause ``crash``, naming the rank); a stop drains rank 0 first, then ends the others. A group that
spans nodes (``whole_group`` False; ``first_rank``: this node's first rank, a follower unless 0)
cannot be restarted in place, as its other nodes' ranks are still in the old group: any death or
restart cause ends this parent with 1, so that the pod restarts and its LeaderWorkerSet recreates the
whole group; a node without rank 0 serves no HTTP and its workers are not probed.

A worker that fails to load before any worker was ever ready ends the parent with its exit code,
as `keepwarm serve` without a parent would end: bad settings or a broken checkpoint do not heal by
retrying. SIGTERM (or SIGINT) first closes the parent's copy of the listening socket, then is passed
to the worker, which stops accepting and drains its requests (uvicorn's graceful shutdown, up to
keepwarm_api.shutdown.DRAIN_S); after ``stop_grace_s`` it is killed. With both copies closed the port
refuses new connections at once instead of queueing them in a backlog nobody will accept from.
"""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import json
import logging
import os
import selectors
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from keepwarm_api.shutdown import DRAIN_S, STOP_MARGIN_S
from keepwarm_runtime.server.worker_probe import PENDING, HealthProbe

logger = logging.getLogger(__name__)

RESTART_CAUSES = ("crash", "hang", "unhealthy")  # label values of keepwarm_worker_restarts_total
STABLE_S = 10.0  # a worker ready this long ends a row of failed restarts
_PR_SET_PDEATHSIG = 1
_HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD)  # the parent's handlers


@dataclass(frozen=True)
class SupervisorConfig:
    host: str  # where the worker's /health is reached (the listening socket's address)
    port: int
    health_timeout: float  # seconds without a /health answer before the worker counts as hung
    # A worker accepts nothing until it has loaded (server/app.py load_before_serving): until it says it
    # serves (notify_serving, or a first /health answer), silence counts as a hang only after this.
    load_timeout: float
    max_failed_restarts: int  # restarts in a row after which the parent's /health answers 503
    health_interval: float = 1.0  # seconds between /health polls of the worker
    backoff_base_s: float = 0.5  # the second restart in a row waits this long, each later one twice that
    backoff_cap_s: float = 30.0
    stop_grace_s: float = DRAIN_S + STOP_MARGIN_S  # SIGTERM to SIGKILL when stopping the worker


@dataclass
class RestartCounts:
    """Restarts by cause since the parent started; a forked worker inherits the counts."""

    by_cause: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RESTART_CAUSES, 0))


RESTARTS = RestartCounts()  # the parent's counts; what a worker reads at start (server/base/metrics.py)
_serving_fd: int | None = None  # in a worker: the pipe on which it tells the parent it serves


def notify_serving() -> None:
    """In a supervised worker, tell the parent it now accepts connections (the app calls this once its
    startup is done); from then on its /health must answer within the hang timeout. A no-op elsewhere."""
    global _serving_fd
    if _serving_fd is None:
        return
    with contextlib.suppress(OSError):
        os.write(_serving_fd, b"S")
        os.close(_serving_fd)
    _serving_fd = None


def backoff_delay(in_a_row: int, base: float, cap: float) -> float:
    """Seconds to wait before the ``in_a_row``-th restart in a row: 0, base, 2 base, 4 base, ... cap."""
    return 0.0 if in_a_row <= 1 else min(cap, base * 2 ** (in_a_row - 2))


def describe_exit(status: int) -> str:
    """A waitpid status in words: "killed by SIGKILL" or "exited with 1"."""
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exited with {os.waitstatus_to_exitcode(status)}"


def bind_listener(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A listening TCP socket on (host, port), as uvicorn would bind it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(backlog)
    return sock


def local_address(host: str) -> str:
    """The address the parent reaches a listener bound to ``host`` on."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def thread_count() -> int:
    """Threads of this process, from /proc (1 when /proc is unavailable)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def fork_hazards() -> list[str]:
    """What would make a fork of this process unsafe: other threads (OpenMP's, tokenizers', ...) or a
    CUDA context. The parent checks before each fork and warns; it is built to have neither."""
    found = []
    if (threads := thread_count()) > 1:
        found.append(f"the parent has {threads} threads")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        found.append("the parent has a CUDA context")
    return found


Worker = Callable[[int, "str | None"], int]  # (rank, the group's rendezvous or None) -> exit code


class Supervisor:
    """Runs ``worker(rank, rendezvous)`` in forked children until stopped, one per rank; ``run()``
    returns the exit code."""

    def __init__(
        self,
        config: SupervisorConfig,
        worker: Worker,
        health: socket.socket,
        close_in_worker: list,
        listener: socket.socket | None = None,
        ranks: int = 1,
        rendezvous: Callable[[], str] | None = None,
        first_rank: int = 0,
        whole_group: bool = True,
    ) -> None:
        self.config, self._worker, self._health = config, worker, health
        self._listener = listener  # the serving socket the workers inherit: closed here on stop
        self._close_in_worker = close_in_worker  # the parent's sockets a worker must not keep
        self.ranks = ranks  # processes of the group forked here: rank 0 serves, the others follow it
        self._rendezvous = rendezvous  # a fresh rendezvous per group start (a group's only)
        self.first_rank = first_rank  # the group's rank of the first process forked here
        self.serves = first_rank == 0  # a node holding rank 0; another node's first rank is a follower
        self.whole_group = whole_group  # False: ranks on other nodes too, so no restart in place
        self._exit_code: int | None = None  # set when this parent must end (a group over nodes failed)
        self.pid: int | None = None  # the first rank forked here: the serving worker on node 0
        self.followers: dict[int, int] = {}  # rank -> pid of the other ranks forked here
        self._spawned_at = self._last_answer = self._ready_at = 0.0
        self._ever_ready = False
        self._answered = False
        self._in_a_row = 0  # restarts in a row that did not lead to a stable worker
        self._restart_at: float | None = None
        self._next_poll = 0.0
        self._probe: HealthProbe | None = None  # the /health request in flight, if any
        self._serving_r: int | None = None  # read end of the worker's "now serving" pipe
        self._stopping = False
        self._parent_pid = os.getpid()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    # --- the loop ---------------------------------------------------------------------------------

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_stop_signal)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        self._health.setblocking(False)
        selector = self._selector
        selector.register(self._wake_r, selectors.EVENT_READ)
        selector.register(self._health, selectors.EVENT_READ)
        try:
            self._spawn()
            while not self._stopping:
                for key, mask in selector.select(self._timeout()):
                    if key.fileobj is self._health:
                        self._answer_health()
                    elif isinstance(key.data, HealthProbe):
                        self._on_probe(key.data, mask)
                    elif key.fileobj == self._serving_r:
                        self._on_serving()
                    else:
                        with contextlib.suppress(BlockingIOError):
                            os.read(self._wake_r, 4096)
                code = self._tick()
                if code is None:
                    code = self._exit_code
                if code is not None:
                    self._kill_worker()
                    return code
            return self._stop_worker()
        finally:
            signal.set_wakeup_fd(-1)
            selector.close()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _timeout(self) -> float:
        due = [self._next_poll] + ([self._restart_at] if self._restart_at is not None else [])
        return max(0.0, min(min(due) - time.monotonic(), 1.0))

    def _tick(self) -> int | None:
        """Reap, poll, restart; an exit code when the parent must end."""
        if self.pid is not None or self.followers:
            ended = self._reap()
            if ended is not None:
                who, status = ended
                self._kill_worker()  # the rest of the group
                if not self._ever_ready and os.WIFEXITED(status) and os.WEXITSTATUS(status) in (1, 2):
                    logger.error("the %s %s before it was ever ready: stopping", who, describe_exit(status))
                    return os.WEXITSTATUS(status)
                self._schedule_restart("crash", f"the {who} {describe_exit(status)}")
        if self.pid is not None and self.serves:
            self._watch_worker()
        if self._restart_at is not None and time.monotonic() >= self._restart_at and not self._stopping:
            self._restart_at = None
            self._spawn()
        return None

    # --- the worker -------------------------------------------------------------------------------

    def _reap(self) -> tuple[str, int] | None:
        """The first process of the group found ended (who, wait status), forgotten; else None."""
        if self.pid is not None:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.pid = None
                who = "worker" if self.ranks == 1 else "worker (rank 0)"
                return (who if self.serves else f"tensor-parallel rank {self.first_rank}"), status
        for rank, pid in list(self.followers.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                del self.followers[rank]
                return f"tensor-parallel rank {rank}", status
        return None

    def _spawn(self) -> None:
        for hazard in fork_hazards():
            logger.warning("forking the worker although %s", hazard)
        rendezvous = self._rendezvous() if self._rendezvous is not None else None
        serving_r, serving_w = os.pipe()
        # A stop signal arriving around the fork must not reach the child's copy of the parent's
        # handler (it would be swallowed): blocked here, it stays pending until the child has put
        # back the default action (and dies of it), or the parent has its handler again.
        signal.pthread_sigmask(signal.SIG_BLOCK, _HANDLED)
        pid = os.fork()
        if pid == 0:
            os.close(serving_r)
            os._exit(self._worker_main(serving_w, self.first_rank, rendezvous))
        for rank in range(self.first_rank + 1, self.first_rank + self.ranks):
            follower = os.fork()
            if follower == 0:
                os.close(serving_r)
                os.close(serving_w)
                os._exit(self._worker_main(None, rank, rendezvous))
            self.followers[rank] = follower
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _HANDLED)
        os.close(serving_w)
        self._serving_r = serving_r
        self._selector.register(serving_r, selectors.EVENT_READ)
        self.pid = pid
        self._spawned_at = self._last_answer = time.monotonic()
        self._ready_at = 0.0
        self._answered = False  # the worker has answered /health at least once
        self._next_poll = self._spawned_at + self.config.health_interval
        ranks = f" with ranks {sorted(self.followers.items())}" if self.followers else ""
        logger.info("worker %d forked%s (restarts so far: %s)", pid, ranks, RESTARTS.by_cause)

    def _worker_main(self, serving_w: int | None, rank: int, rendezvous: str | None) -> int:
        """In the child: undo the parent's signal set-up, die with the parent, then serve."""
        global _serving_fd
        _serving_fd = serving_w
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            for sig in _HANDLED:
                signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _HANDLED)
            for sock in self._close_in_worker:
                sock.close()
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._selector.close()
            _die_with_parent(self._parent_pid)
            code = self._worker(rank, rendezvous)
        except BaseException:
            logger.exception("the worker failed")
        finally:
            logging.shutdown()
        return code

    def _watch_worker(self) -> None:
        """Start a /health probe when one is due (none in flight); restart a worker silent too long."""
        now = time.monotonic()
        silent = now - self._last_answer
        if self._answered:
            allowed, why = self.config.health_timeout, "the worker's /health went unanswered for {:.1f}s"
        else:
            allowed = max(self.config.load_timeout, self.config.health_timeout)
            why = "the worker did not serve within {:.1f}s of its fork"
        if silent > allowed:
            self._kill_worker()
            self._schedule_restart("hang", why.format(silent))
            return
        if self._probe is None and now >= self._next_poll:
            self._next_poll = now + self.config.health_interval
            self._probe = HealthProbe((local_address(self.config.host), self.config.port), self._selector)
            self._probe.start()

    def _on_serving(self) -> None:
        """The worker accepts connections now (or died: EOF); silence counts from here."""
        try:
            data = os.read(self._serving_r, 16) if self._serving_r is not None else b""
        except OSError:
            data = b""
        if data:
            self._last_answer, self._answered = time.monotonic(), True
        self._close_serving_pipe()

    def _close_serving_pipe(self) -> None:
        if self._serving_r is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(self._serving_r)
            os.close(self._serving_r)
            self._serving_r = None

    def _on_probe(self, probe: HealthProbe, mask: int) -> None:
        state = probe.on_event(mask)
        if state == PENDING:
            return
        self._probe = None
        if state is None or self.pid is None:
            return  # refused or cut off: silence, judged by time in _watch_worker
        now = time.monotonic()
        self._last_answer, self._answered = now, True
        if state == "failed":
            self._kill_worker()
            self._schedule_restart("unhealthy", "the worker's engine failed (/health 503)")
        elif state == "ready":
            self._ever_ready = True
            self._ready_at = self._ready_at or now
            if now - self._ready_at >= STABLE_S:
                self._in_a_row = 0

    def _kill_worker(self) -> None:
        """Kill every process of the group still running, and reap it."""
        self._drop_worker_io()
        pids = ([self.pid] if self.pid is not None else []) + list(self.followers.values())
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in pids:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        self.pid = None
        self.followers.clear()

    def _drop_worker_io(self) -> None:
        """Forget the worker's probe and pipe (it is dead or about to be)."""
        self._close_serving_pipe()
        if self._probe is not None:
            self._probe.close()
            self._probe = None

    def _schedule_restart(self, cause: str, why: str) -> None:
        self._drop_worker_io()
        if not self.whole_group:  # the other nodes' ranks are still in the old group: none can rejoin
            logger.error(
                "%s; the group spans nodes, so this node exits and the group restarts as a whole "
                "(a LeaderWorkerSet recreates every pod of a group when one restarts)",
                why,
            )
            self._exit_code = 1
            return
        RESTARTS.by_cause[cause] += 1
        self._in_a_row += 1
        delay = backoff_delay(self._in_a_row, self.config.backoff_base_s, self.config.backoff_cap_s)
        logger.error(
            "restarting the worker (%s, restart %d in a row, in %.1fs): %s", cause, self._in_a_row, delay, why
        )
        self._restart_at = time.monotonic() + delay

    def _stop_worker(self) -> int:
        """Close the parent's listening socket, SIGTERM the worker (it stops accepting and drains its
        requests), SIGKILL it after the grace period."""
        if self._listener is not None:
            self._listener.close()  # the worker's copy alone keeps the port open, until it stops
        if self.pid is None or not self.serves:
            self._kill_worker()  # ranks with no rank 0 here to drain first
            return 0
        logger.info("stopping worker %d (grace %.0fs)", self.pid, self.config.stop_grace_s)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.config.stop_grace_s
        while time.monotonic() < deadline:
            done, _ = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.pid = None
                self._kill_worker()  # rank 0 drained its requests: the ranks that followed it go too
                return 0
            time.sleep(0.05)
        logger.warning("worker %d did not stop within %.0fs: killing it", self.pid, self.config.stop_grace_s)
        self._kill_worker()
        return 0

    def _on_stop_signal(self, *_: object) -> None:
        self._stopping = True

    # --- the parent's own /health -----------------------------------------------------------------

    @property
    def alive(self) -> bool:
        """Whether the parent can still recover: fewer failed restarts in a row than the limit."""
        return self._in_a_row < self.config.max_failed_restarts

    def _answer_health(self) -> None:
        try:
            conn, _ = self._health.accept()
        except (BlockingIOError, InterruptedError):
            return
        with conn:
            conn.settimeout(0.5)
            try:
                request = conn.recv(4096)
            except OSError:
                return
            path = request.split(b" ", 2)[1] if request.count(b" ") >= 2 else b""
            if path.split(b"?")[0] not in (b"/health", b"/ping"):
                _reply(conn, 404, {"error": "not found: the parent answers /health only"})
                return
            body = {
                "status": "ok" if self.alive else "failing",
                "worker_pid": self.pid,
                "rank_pids": {str(rank): pid for rank, pid in sorted(self.followers.items())},
                "restarts_in_a_row": self._in_a_row,
                "max_failed_restarts": self.config.max_failed_restarts,
                "restarts": RESTARTS.by_cause,
            }
            _reply(conn, 200 if self.alive else 503, body)


def _reply(conn: socket.socket, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    head = f"HTTP/1.1 {status} {http.client.responses[status]}\r\ncontent-type: application/json\r\n"
    head += f"content-length: {len(data)}\r\nconnection: close\r\n\r\n"
    with contextlib.suppress(OSError):
        conn.sendall(head.encode() + data)


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this worker when the parent dies, so no orphan keeps serving the port."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(1)
