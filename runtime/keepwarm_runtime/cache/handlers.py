"""One method per protocol command; each returns (reply header, fds to send and then close)."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from keepwarm_runtime import __version__
from keepwarm_runtime.cache.fingerprint import WeightCacheKey
from keepwarm_runtime.cache.protocol import PROTOCOL_VERSION, error_reply

if TYPE_CHECKING:
    from keepwarm_runtime.cache.daemon import CacheDaemon

Reply = tuple[dict[str, Any], list[int]]


class CommandHandlers:
    def __init__(self, daemon: CacheDaemon) -> None:
        self.daemon = daemon

    def dispatch(self, request: dict[str, Any]) -> Reply:
        cmd = request.get("cmd")
        handler = getattr(self, f"cmd_{cmd}", None) if isinstance(cmd, str) else None
        if handler is None:
            return error_reply("unknown_command", f"unknown command {cmd!r}"), []
        try:
            return handler(request)
        except (KeyError, TypeError, ValueError) as exc:
            return error_reply("bad_request", f"{cmd}: {exc}"), []

    def cmd_hello(self, request: dict[str, Any]) -> Reply:
        d = self.daemon
        return {
            "ok": True,
            "protocol": PROTOCOL_VERSION,
            "version": __version__,
            "pid": os.getpid(),
            "tier": d.tier,
            "gpu_uuid": d.gpu_uuid,
            "dtype": d.config.dtype,
        }, []

    def cmd_get_state(self, request: dict[str, Any]) -> Reply:
        started = time.perf_counter()
        key = WeightCacheKey.from_dict(request["key"])
        found = self.daemon.registry.lookup(key, request.get("name"))
        state, model, fields = found.state, found.model, found.fields
        metrics = self.daemon.metrics
        if state == "hit":
            metrics.hits.labels(model.name).inc()
            reply = {
                "ok": True,
                "state": "hit",
                "model": model.name,
                "tier": model.tier,
                "size": model.nbytes,
                "page_mode": model.arena.page_mode,
                "gpu_uuid": model.gpu_uuid,
                "digest": model.digest,
                "tensors": [e.to_wire() for e in model.layout.entries],
                "aliases": {},
            }
            metrics.request_seconds.observe(time.perf_counter() - started)
            return reply, [found.fd]
        metrics.misses.labels(state).inc()
        reply = {"ok": True, "state": state, "fields": fields}
        if model is not None:
            reply["model"] = model.name
        return reply, []

    def cmd_list(self, request: dict[str, Any]) -> Reply:
        models = [
            {
                "name": m.name,
                "bytes": m.nbytes,
                "pinned": m.pinned,
                "tier": m.tier,
                "key_digest": m.key.digest,
                "path": str(m.path),
            }
            for m in self.daemon.registry.models()
        ]
        return {"ok": True, "models": models}, []

    def cmd_release(self, request: dict[str, Any]) -> Reply:
        name = str(request["model"])
        model = self.daemon.registry.get(name)
        if model is None:
            return error_reply("not_found", f"no resident model named {name!r}"), []
        if model.pinned and not request.get("force"):
            return error_reply("pinned", f"model {name!r} is pinned; pass force to release it"), []
        self.daemon.remove_model(name)
        return {"ok": True, "released": name, "bytes": model.nbytes}, []

    def cmd_stats(self, request: dict[str, Any]) -> Reply:
        return {"ok": True, **self.daemon.snapshot()}, []
