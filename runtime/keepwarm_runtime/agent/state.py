"""Pure parts of the node agent: which models the WeightCache wants here, and the status to report.

The operator's API models live in another distribution (keepwarm-operator), so this reads the
WeightCache as the plain dict the API server returns; field names are the CRD's.
"""

from __future__ import annotations

import datetime as dt
import os
from dataclasses import dataclass, field
from typing import Any

MODEL_ROOT = os.environ.get("KEEPWARM_MODEL_ROOT", "/models")  # where the DaemonSet mounts sources
HF_ROOT = "/var/cache/keepwarm/huggingface"


@dataclass(frozen=True)
class WantedModel:
    name: str  # model name in the WeightCache
    path: str | None  # directory to load (None for a Hub source still to download)
    pin: bool
    repo: str | None = None  # Hugging Face source
    revision: str | None = None


@dataclass
class AgentState:
    """What the agent knows between ticks (owned by the agent thread, read by the reporter)."""

    daemon_names: dict[str, str] = field(default_factory=dict)  # WeightCache name -> daemon name
    loading: set[str] = field(default_factory=set)
    failed: dict[str, str] = field(default_factory=dict)  # name -> message
    evicted: set[str] = field(default_factory=set)
    generation: int | None = None  # WeightCache generation last acted on
    message: str = ""
    started: str = field(default_factory=lambda: _now())  # reporting since (Stale=False transition)


def wanted_models(cache: dict[str, Any], model_root: str = MODEL_ROOT) -> list[WantedModel]:
    out = []
    for m in (cache.get("spec") or {}).get("models", []):
        source = m.get("source") or {}
        pin = bool(m.get("pin", False))
        if "huggingFace" in source:
            hf = source["huggingFace"]
            out.append(WantedModel(m["name"], None, pin, hf["repo"], hf["revision"]))
        else:  # path and pvc sources are mounted at <root>/<name> by the DaemonSet
            out.append(WantedModel(m["name"], f"{model_root}/{m['name']}", pin))
    return out


def _now() -> str:
    return dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def node_status(
    state: AgentState, snapshot: dict[str, Any], wanted: list[WantedModel], version: str
) -> dict[str, Any]:
    """The WeightCacheNode status body (CRD field names) from the daemon's snapshot."""
    resident = snapshot.get("models", {})
    models = []
    for w in wanted:
        entry: dict[str, Any] = {"name": w.name, "pinned": w.pin, "tier": snapshot.get("tier", "")}
        daemon_name = state.daemon_names.get(w.name)
        if daemon_name in resident:
            info = resident[daemon_name]
            entry |= {
                "state": "Resident",
                "bytes": info["bytes"],
                "fingerprint": info.get("key_digest", ""),
                "digest": info.get("digest", ""),
                "pinned": info.get("pinned", w.pin),
                "gpuUuids": info.get("gpu_uuids", []),
            }
        elif w.name in state.failed:
            entry |= {"state": "Failed", "message": state.failed[w.name][:1000]}
        elif w.name in state.evicted:
            entry |= {
                "state": "Evicted",
                "message": "evicted under the budget; re-added on the next spec change",
            }
        else:
            entry["state"] = "Loading"
        models.append(entry)
    states = {m["state"] for m in models}
    if "Failed" in states:
        phase = "Degraded"
    elif states <= {"Resident", "Evicted"}:
        phase = "Ready"
    else:
        phase = "Loading"
    gpus = sorted({u for m in models for u in m.get("gpuUuids", [])} | ({snapshot["gpu_uuid"]} - {None}))
    return {
        "phase": phase,
        "heartbeat": _now(),
        "models": models,
        "totalBytes": sum(m.get("bytes", 0) for m in models),
        "gpuUuids": gpus,
        "agentVersion": version,
        "message": state.message,
        "conditions": [
            {
                "type": "Stale",
                "status": "False",
                "reason": "HeartbeatFresh",
                "message": "",
                "lastTransitionTime": _now(),
            }
        ],
    }
