"""`--lora-modules` values and `--lora-modules-file` contents; standard library only, so the settings and
`keepwarm --help` stay light."""

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
        return _json_form(data, repr(text))
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"{text!r} is not name=path")
    return LoraModule(name.strip(), path.strip())


def _json_form(data: object, where: str) -> LoraModule:
    base = data.get("base_model_name") if isinstance(data, dict) else None
    if (
        not isinstance(data, dict)
        or set(data) - {"name", "path", "base_model_name"}
        or not isinstance(data.get("name"), str)
        or not data["name"].strip()
        or not isinstance(data.get("path"), str)
        or not data["path"].strip()
        or not isinstance(base, str | None)
    ):
        raise ValueError(f"{where}: JSON form needs string name and path (and optional base_model_name)")
    return LoraModule(data["name"], data["path"], base)


def parse_lora_modules_file(text: str, where: str) -> tuple[LoraModule, ...]:
    """A ``--lora-modules-file``: a JSON list of the JSON form, names unique (keepwarm_api.serveflags
    .lora_modules_file writes it). ValueError naming ``where`` (the file) and the first problem."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where} is not valid JSON: {exc}") from None
    if not isinstance(data, list):
        raise ValueError(f"{where}: expected a JSON list of {{name, path}} objects")
    modules = tuple(_json_form(entry, f"{where} entry {i}") for i, entry in enumerate(data))
    names = [m.name for m in modules]
    if twice := next((n for n in names if names.count(n) > 1), None):
        raise ValueError(f"{where}: adapter {twice!r} is listed twice")
    return modules
