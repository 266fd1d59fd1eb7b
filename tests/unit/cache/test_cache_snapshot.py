"""The daemon's snapshot (cache/snapshot.py): its wire form is the stats reply protocol.py documents,
key for key and in order, and the node agent reports what that wire form says."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from keepwarm_api.weightcachenode import PEERS_REFUSED
from keepwarm_runtime.agent.state import AgentState, DaemonBook, WantedModel, node_status
from keepwarm_runtime.cache import protocol
from keepwarm_runtime.cache.daemon import CacheDaemon, DaemonConfig
from tests.unit.cache.test_cache_daemon import write_checkpoint


def documented_stats_keys() -> list[str]:
    """The keys protocol.py's docstring gives the stats reply, in its order (a resident model's keys
    where they nest, after "models")."""
    (bullet,) = [b for b in (protocol.__doc__ or "").split("\n* ") if b.startswith("``stats``")]
    return re.findall(r"``([a-z_]+)``", bullet)[1:]  # [0] is the command's own name


@pytest.fixture
def daemon(tmp_path: Path):
    """A host-tier daemon with a budget holding one pinned model, with one failed model and one
    refused peer."""
    models = tmp_path / "models"
    d = CacheDaemon(DaemonConfig(socket_dir=tmp_path / "sock", tier="host", dtype="bfloat16", budget=1 << 30))
    d.add_model(write_checkpoint(models / "m0", seed=0), pin=True)
    (models / "broken").mkdir()
    with pytest.raises(Exception, match="broken"):
        d.add_model(models / "broken")
    d.refusals.record("uid 7 with gids [7] is not allowed")  # now: recent enough to be reported
    yield d
    d.close()


def test_the_stats_reply_is_the_snapshot_in_the_order_the_protocol_documents(daemon):
    snap = daemon.snapshot()
    reply, fds = daemon.handlers.dispatch({"cmd": "stats"})
    assert fds == [] and reply == {"ok": True, **snap.wire()}
    wire = snap.wire()
    entry = wire["models"]["m0"]
    keys = list(wire)
    at = keys.index("models") + 1
    assert keys[:at] + list(entry) + keys[at:] == documented_stats_keys()
    assert (entry["state"], entry["kind"], entry["bytes"]) == ("Resident", "model", wire["resident_bytes"])
    assert wire["failed"]["broken"] == {
        "state": "Failed",
        "path": str(snap.failed["broken"].path),
        "reason": snap.failed["broken"].reason,
    }
    assert wire["refusals"] == snap.refusals.wire() and wire["budget"] == 1 << 30
    assert protocol.decode_header(protocol.encode(reply)[4:]) == reply  # plain JSON, as sent


def test_the_agent_reports_what_the_wire_form_says(daemon):
    snap = daemon.snapshot()
    wanted = [WantedModel("llama", str(snap.models["m0"].path), pin=False)]
    state = AgentState(books={"": DaemonBook(daemon_names={"llama": "m0"})})
    status = node_status(state, {"": snap}, wanted, "v")
    (reported,) = status.wire()["models"]
    entry = snap.wire()["models"]["m0"]
    assert reported["state"] == "Resident"
    assert (reported["bytes"], reported["fingerprint"], reported["digest"]) == (
        entry["bytes"],
        entry["key_digest"],
        entry["digest"],
    )
    assert (reported["pinned"], reported["tier"]) == (entry["pinned"], entry["tier"]) == (True, "host")
    assert reported.get("gpuUuids", []) == entry["gpu_uuids"]
    (refused,) = [c for c in status.wire()["conditions"] if c["type"] == PEERS_REFUSED]
    assert refused["message"].startswith(snap.wire()["refusals"]["reason"])
