"""Write the custom resources' field reference, docs/reference/crds.md, from the CRDs the pydantic models
generate (keepwarm_api.crdgen: the same schemas the API server validates with).

    python scripts/crd_reference.py     # rewrites each kind's section; a test checks drift

Per kind, between ``<!-- crd:KIND:begin -->`` and ``<!-- crd:KIND:end -->``: its scope and short names,
one row per field of spec and status (path, type with its bounds, default, description; required
fields marked), then the CEL rules the API server checks, each with its message.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from keepwarm_api.crdgen import KINDS, KindSpec, crd

PAGE = Path(__file__).resolve().parents[1] / "docs" / "reference" / "crds.md"


def markers(kind: str) -> tuple[str, str]:
    return f"<!-- crd:{kind}:begin -->", f"<!-- crd:{kind}:end -->"


def cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def type_of(node: dict[str, Any]) -> str:
    """The field's type as a reader checks it: base type, element or value type, enum and bounds."""
    if node.get("x-kubernetes-int-or-string"):
        kind = "quantity (int or string)"
    elif node.get("type") == "array":
        kind = f"list of {type_of(node.get('items', {}))}"
    elif node.get("type") == "object" and "additionalProperties" in node:
        kind = f"map of {type_of(node['additionalProperties'])}"
    else:
        kind = node.get("type", "any")
    bounds = []
    if "enum" in node:
        bounds.append("one of " + ", ".join(f"`{v}`" for v in node["enum"]))
    for key, say in (
        ("minimum", ">="),
        ("maximum", "<="),
        ("minLength", "length >="),
        ("maxLength", "length <="),
    ):
        if key in node:
            bounds.append(f"{say} {node[key]}")
    if "maxItems" in node:
        bounds.append(f"at most {node['maxItems']} items")
    if "pattern" in node:
        bounds.append(f"pattern `{node['pattern']}`")
    return kind + (f" ({'; '.join(bounds)})" if bounds else "")


def fields(node: dict[str, Any], path: str, required: bool) -> Iterator[tuple[str, dict[str, Any], bool]]:
    """(path, schema, required) of every field under ``node``, depth first in declaration order."""
    yield path, node, required
    if node.get("type") == "array":
        node = node.get("items", {})
        path += "[]"
    for name, child in node.get("properties", {}).items():
        yield from fields(child, f"{path}.{name}", name in node.get("required", []))


def rules(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, str]]]:
    """(path, rule) of every CEL rule (x-kubernetes-validations) under ``node``."""
    for rule in node.get("x-kubernetes-validations", []):
        yield path, rule
    if node.get("type") == "array":
        yield from rules(node.get("items", {}), path + "[]")
    for name, child in node.get("properties", {}).items():
        yield from rules(child, f"{path}.{name}")


def section(kind: KindSpec) -> str:
    doc = crd(kind)
    root = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    names, version = doc["spec"]["names"], doc["spec"]["versions"][0]["name"]
    lines = [
        f"`{doc['spec']['group']}/{version}`, {doc['spec']['scope'].lower()}-scoped, "
        f"plural `{names['plural']}`, short names {', '.join(f'`{n}`' for n in names['shortNames'])}. "
        f"{root['description']}",
        "",
        "| field | type | default | description |",
        "|---|---|---|---|",
    ]
    for part in ("spec", "status"):
        top = root["properties"][part]
        for path, node, required in fields(top, part, part in root.get("required", [])):
            if path == part:
                continue
            default = f"`{json.dumps(node['default'])}`" if "default" in node else ""
            name = f"`{path}`" + (" (required)" if required else "")
            text = node.get("description", "")
            lines.append(f"| {name} | {cell(type_of(node))} | {cell(default)} | {cell(text)} |")
    checked = list(rules(root, ""))
    if checked:
        lines += ["", "Rules the API server checks (CEL), with the message it answers:", ""]
        for path, rule in checked:
            where = f"`{path.lstrip('.')}`" if path else "the object"
            lines.append(f"- on {where}: {rule['message']} (`{rule['rule']}`)")
    return "\n".join(lines)


def rewrite(text: str) -> str:
    """``text`` with every kind's section replaced by the generated one; a missing marker is a ValueError."""
    for kind in KINDS:
        begin, end = markers(kind.kind)
        if begin not in text or end not in text:
            raise ValueError(f"{PAGE.name} lacks the markers {begin} ... {end}")
        start, stop = text.index(begin) + len(begin), text.index(end)
        text = text[:start] + "\n" + section(kind) + "\n" + text[stop:]
    return text


def main() -> int:
    PAGE.write_text(rewrite(PAGE.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
