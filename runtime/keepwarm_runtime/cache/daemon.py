"""The cache daemon: loads checkpoints once, holds them in a tier, serves them over a Unix socket.

``CacheDaemon`` is the daemon core (core.py: the resident set and the operations on it) composed
with what serves it: the request handlers (handlers.py), the connection loop (connections.py), the
hand-off to and from another daemon (succession.py) and the descriptor holder (holder_link.py). It
is also the in-process API of the node agent (``add_model``, ``remove_model``, ``snapshot`` are
thread-safe). Start order: ``claim`` (socket directory and lock; when another daemon holds the lock,
take its arenas over instead, before loading anything: succession.py; after a crash, take back what
the descriptor holder kept: holder_link.py), load the initial models it still lacks, ``bind`` (after
a take-over: commit, and serve the predecessor's own listener), ``serve_forever``; a client that can
connect can attach, and one ``READY`` line on stderr says so. Models taken over or back are served
without importing torch (core.py), so a restart answers in an interpreter's start-up time.

``--adapter`` (and ``add_model(kind="adapter")``) loads a PEFT LoRA adapter directory the same way,
laid out as stored (cache/adapters.py): none of the model conversions (online FP8, expert layouts)
apply to it; clients attach it with ``client.attach_adapter``.

A model that fails to load (bad shard, no room under the budget, unsealable arena) is ``Failed`` with
a reason naming the file, in ``stats``/``list`` and metrics; it never costs a resident model its
place, because every header is validated before anything is evicted. A resident model whose shard
changes on disk is never served again: the next request that touches it is a miss and starts a
reload in the background, which replaces it (or, failing, drops it and marks it Failed).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading

from keepwarm_runtime.cache import security, succession
from keepwarm_runtime.cache.connections import SocketServer
from keepwarm_runtime.cache.core import DaemonConfig, DaemonCore
from keepwarm_runtime.cache.handlers import CommandHandlers
from keepwarm_runtime.cache.holder_link import HolderLink
from keepwarm_runtime.cache.limits import raise_nofile_limit
from keepwarm_runtime.cache.metrics import ARENA_SOURCES
from keepwarm_runtime.cache.succession import Inheritance

__all__ = ["CacheDaemon", "DaemonConfig"]


class CacheDaemon(DaemonCore):
    def __init__(self, config: DaemonConfig) -> None:
        super().__init__(config)
        self.handlers = CommandHandlers(self)
        self.holder_link = HolderLink(self)
        self._gid = security.resolve_gid(config.group)
        self._inheritance: Inheritance | None = None  # from a predecessor, until bind() commits it
        self.took_over = False  # this daemon serves a predecessor's socket (bind committed it)
        self._nofile = 0

    def claim(self) -> None:
        """Prepare the socket directory and take the lock, or take everything over from the daemon
        holding it: call before loading anything, so that nothing resident is read again."""
        if self.lock.held or self._inheritance is not None:
            return
        security.prepare_socket_dir(self.socket_dir, self._gid)
        try:
            self.lock.acquire()
        except security.DaemonAlreadyRunning as busy:
            self._inheritance = succession.take_over(self, busy)
            if self._inheritance is not None:
                return
        self.holder_link.recover()  # after a crash: what the holder kept for this socket

    def sync_holder(self) -> None:
        """Give the holder (when one runs) this socket's current arenas, replacing what it kept."""
        if self.listener is None:
            return  # not serving yet: the holder link deposits once bind() is done
        self.holder_link.deposit()

    def bind(self) -> None:
        """Take the lock (if ``claim`` did not), clear a stale socket, bind and listen."""
        self.claim()
        self._nofile = raise_nofile_limit()
        if self._inheritance is not None:  # the predecessor's listener: no connection is ever refused
            inheritance, self._inheritance = self._inheritance, None
            self.took_over = True
            listener = socket.socket(fileno=inheritance.listener_fd)
            try:
                succession.commit(self, inheritance)
            except BaseException:
                listener.detach()  # commit closed the descriptor
                raise
        else:
            listener = security.bind_private(self.socket_path, self.lock)
        security.secure_socket_file(self.socket_path, self._gid)
        listener.listen(socket.SOMAXCONN)  # a restart storm of pods queues instead of failing
        listener.settimeout(0.2)
        self.listener = listener
        # The holder gets this daemon's arenas from that thread, first thing: not on the way to serving.
        watch = threading.Thread(
            target=self.holder_link.watch, args=(self._stop,), daemon=True, name="holder"
        )
        watch.start()
        self._count_start()
        if self.config.metrics_port is not None:
            self.metrics.serve(self.config.metrics_port, took_over=self.took_over)

    def _count_start(self) -> None:
        """Where the arenas this daemon begins serving came from (keepwarm_cache_start_arenas): a
        start that read everything from disk although a predecessor or the holder had it shows here."""
        origins = [m.origin for m in self.registry.models()]
        for source in ARENA_SOURCES:
            self.metrics.start_arenas.labels(source).set(origins.count(source))

    def serve_forever(self) -> None:
        if self.listener is None:
            self.bind()
        assert self.listener is not None
        names = ",".join(m.name for m in self.registry.models()) or "-"
        print(
            f"READY keepwarm cache socket={self.socket_path} tier={self.tier} models={names} "
            f"pid={os.getpid()}",
            file=sys.stderr,
            flush=True,
        )
        try:
            server = SocketServer(self, self.handlers, self.listener, self.config.limits, self._nofile)
            server.serve(self._stop)
        finally:
            self.close()

    def close(self) -> None:
        if self._inheritance is not None:  # never committed: the predecessor keeps serving
            inheritance, self._inheritance = self._inheritance, None
            inheritance.sock.close()
            os.close(inheritance.listener_fd)
            os.close(inheritance.lock_fd)
        if self.listener is not None:
            self.listener.close()
            self.listener = None
            if self.lock.held and not self.handed_off:  # a successor serves this socket now
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.socket_path)
        self.lock.release()
        self._stop.set()  # so that dropping the arenas leaves the holder's copies alone
        for model in self.registry.models():
            if self.handed_off:  # the successor holds its own descriptors: nothing is released
                self.registry.remove(model.name)
                model.arena.close()
            else:
                self.remove_model(model.name)
