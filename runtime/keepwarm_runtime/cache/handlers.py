"""One method per protocol command; each returns (reply header, fds to send and then close).

The handlers read and change the daemon core (core.py) and nothing else; a hit's tensor table is the
one the resident model carries, so answering needs no torch.

A request that is well-formed JSON but malformed for its command (missing or mistyped fields) raises
``BadRequest``: the connection answers it with an error frame and closes, like any bad frame. A
well-formed request for an unknown command, or one the daemon declines (``not_found``, ``pinned``),
is an ordinary error reply and the connection stays open.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from keepwarm_runtime import __version__
from keepwarm_runtime.cache.fingerprint import WeightCacheKey
from keepwarm_runtime.cache.protocol import PROTOCOL_VERSION, ProtocolError, error_reply
from keepwarm_runtime.weights.files import changed_shards

if TYPE_CHECKING:
    from keepwarm_runtime.cache.core import DaemonCore

Reply = tuple[dict[str, Any], list[int]]
CHANGED_ON_DISK = "changed on disk"  # get_state miss reason: a resident model's shard was rewritten


class BadRequest(ProtocolError):
    """The request's fields are malformed: reply with ``bad_request`` and close."""

    def __init__(self, message: str) -> None:
        super().__init__("bad_request", message)


def _str_field(request: dict[str, Any], name: str, required: bool = True) -> str | None:
    value = request.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, str) or len(value) > 4096:
        raise BadRequest(f"{request.get('cmd')}: field {name!r} must be a string")
    return value


class CommandHandlers:
    def __init__(self, daemon: DaemonCore) -> None:
        self.daemon = daemon

    def dispatch(self, request: dict[str, Any]) -> Reply:
        """Run one request; raises BadRequest for malformed fields (never any other exception)."""
        cmd = request.get("cmd")
        handler = getattr(self, f"cmd_{cmd}", None) if isinstance(cmd, str) and cmd.isidentifier() else None
        if handler is None:
            return error_reply("unknown_command", f"unknown command {str(cmd)[:64]!r}"), []
        try:
            return handler(request)
        except BadRequest:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise BadRequest(f"{cmd}: {str(exc)[:300]}") from None

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
        key = WeightCacheKey.from_dict(request.get("key"))
        found = self.daemon.registry.lookup(key, _str_field(request, "name", required=False))
        state, model, fields = found.state, found.model, found.fields
        metrics = self.daemon.metrics
        # The daemon re-checks the files itself: a client's key alone never drops a model.
        changed = changed_shards(model.shards) if model is not None else []
        if changed:
            if found.fd >= 0:
                os.close(found.fd)
            self.daemon.changed_on_disk(model, changed)
            metrics.misses.labels("mismatch").inc()
            return {
                "ok": True,
                "state": "mismatch",
                "fields": ["files"],
                "reason": CHANGED_ON_DISK,
                "model": model.name,
            }, []
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
                "tensors": model.tensors,
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
                "state": "Resident",
                "bytes": m.nbytes,
                "pinned": m.pinned,
                "tier": m.tier,
                "key_digest": m.key.digest,
                "path": str(m.path),
                "kind": m.kind,
            }
            for m in self.daemon.registry.models()
        ]
        models += [{"name": name, **f.wire()} for name, f in self.daemon.failed_models().items()]
        return {"ok": True, "models": models}, []

    def cmd_release(self, request: dict[str, Any]) -> Reply:
        name = _str_field(request, "model")
        force = request.get("force", False)
        if not isinstance(force, bool):
            raise BadRequest("release: field 'force' must be a boolean")
        model = self.daemon.registry.get(name)
        if model is None:
            return error_reply("not_found", f"no resident model named {name!r}"), []
        if model.pinned and not force:
            return error_reply("pinned", f"model {name!r} is pinned; pass force to release it"), []
        self.daemon.remove_model(name)
        return {"ok": True, "released": name, "bytes": model.nbytes}, []

    def cmd_stats(self, request: dict[str, Any]) -> Reply:
        return {"ok": True, **self.daemon.snapshot().wire()}, []
