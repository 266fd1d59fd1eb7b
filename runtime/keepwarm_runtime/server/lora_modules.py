"""`--lora-modules` values; standard library only, so the settings and `keepwarm --help` stay light."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class LoraModule:
    """One adapter the server serves: clients name it in ``model``."""

    name: str
    path: str
    base_model_name: str | None = None  # vLLM's JSON form: the model it was trained for (informational)


def parse_lora_module(text: str) -> LoraModule:
    """``name=path`` or vLLM's JSON form ``{"name": .., "path": .., "base_model_name": ..}``."""
    text = text.strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{text!r} is not valid JSON: {exc}") from None
        unknown = sorted(set(data) - {"name", "path", "base_model_name"})
        if unknown or not isinstance(data.get("name"), str) or not isinstance(data.get("path"), str):
            raise ValueError(f"{text!r}: JSON form needs string name and path (and optional base_model_name)")
        return LoraModule(data["name"], data["path"], data.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"{text!r} is not name=path")
    return LoraModule(name.strip(), path.strip())
