"""Generate the CRDs from the pydantic models: `python -m keepwarm_api.crdgen charts/keepwarm/crds`.

Their one committed home is the chart's crds/ folder (Helm installs them from there; without Helm,
`kubectl apply -f charts/keepwarm/crds`); `make crds` writes it and a test fails when it drifts.

pydantic's JSON Schema is close to a structural OpenAPI v3 schema; this module closes the gap: it
inlines $refs, turns Optional into a plain type (the API server stores absence, not null), drops
titles, and keeps the Kubernetes extensions (x-kubernetes-*) the models declare.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from . import inferencedeployment as idep
from . import weightcache as wc
from . import weightcachenode as wcn
from .common import GROUP, VERSION


@dataclass(frozen=True)
class KindSpec:
    """What a CRD needs beyond the schema."""

    kind: str  # e.g. WeightCache
    plural: str  # e.g. weightcaches
    scope: str  # Cluster or Namespaced
    spec: type[BaseModel]
    status: type[BaseModel]
    short_names: list[str]
    printer_columns: list[dict[str, str]]
    root_validations: list[dict[str, str]] = field(default_factory=list)
    scale: dict[str, str] | None = None  # scale subresource paths
    categories: list[str] = field(default_factory=lambda: ["keepwarm"])


KINDS = [
    KindSpec(
        wc.KIND,
        wc.PLURAL,
        "Cluster",
        wc.WeightCacheSpec,
        wc.WeightCacheStatus,
        wc.SHORT_NAMES,
        wc.PRINTER_COLUMNS,
        wc.ROOT_VALIDATIONS,
    ),
    KindSpec(
        wcn.KIND,
        wcn.PLURAL,
        "Cluster",
        wcn.WeightCacheNodeSpec,
        wcn.WeightCacheNodeStatus,
        wcn.SHORT_NAMES,
        wcn.PRINTER_COLUMNS,
    ),
    KindSpec(
        idep.KIND,
        idep.PLURAL,
        "Namespaced",
        idep.InferenceDeploymentSpec,
        idep.InferenceDeploymentStatus,
        idep.SHORT_NAMES,
        idep.PRINTER_COLUMNS,
        idep.ROOT_VALIDATIONS,
        idep.SCALE,
    ),
]

_DROP = {"title", "$defs"}


def _structural(node: Any, defs: dict[str, Any]) -> Any:
    """Inline refs, collapse Optional, drop what structural schemas forbid."""
    if isinstance(node, list):
        return [_structural(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = dict(defs[node["$ref"].rsplit("/", 1)[-1]])
        extra = {k: v for k, v in node.items() if k != "$ref"}
        return _structural({**target, **extra}, defs)
    if "anyOf" in node and not node.get("x-kubernetes-int-or-string"):
        options = [o for o in node["anyOf"] if o.get("type") != "null"]
        if len(options) == 1:
            rest = {k: v for k, v in node.items() if k != "anyOf"}
            if rest.get("default", "") is None:
                rest.pop("default")
            return _structural({**options[0], **rest}, defs)
    if "enum" in node and "type" not in node:
        node = {**node, "type": "string"}
    out = {k: _structural(v, defs) for k, v in node.items() if k not in _DROP}
    if out.get("default", "") is None:
        out.pop("default")
    if isinstance(out.get("description"), str):
        out["description"] = " ".join(out["description"].split())
    return out


def schema_of(model: type[BaseModel]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return _structural(raw, raw.get("$defs", {}))


def crd(spec: KindSpec) -> dict[str, Any]:
    """The CustomResourceDefinition for one kind."""
    root: dict[str, Any] = {
        "type": "object",
        "description": " ".join(
            ((spec.spec.__module__ and sys.modules[spec.spec.__module__].__doc__) or "").split()
        ),
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": schema_of(spec.spec),
            "status": schema_of(spec.status),
        },
    }
    if spec.root_validations:
        root["x-kubernetes-validations"] = spec.root_validations
    subresources: dict[str, Any] = {"status": {}}
    if spec.scale:
        subresources["scale"] = spec.scale
    singular = spec.kind.lower()
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{spec.plural}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": spec.scope,
            "names": {
                "kind": spec.kind,
                "listKind": f"{spec.kind}List",
                "plural": spec.plural,
                "singular": singular,
                "shortNames": spec.short_names,
                "categories": spec.categories,
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": root},
                    "subresources": subresources,
                    "additionalPrinterColumns": spec.printer_columns,
                }
            ],
        },
    }


def render_all() -> dict[str, str]:
    """File name -> YAML text for every CRD (including kopf's peering CRD)."""
    header = "# Generated by `make crds` (python -m keepwarm_api.crdgen charts/keepwarm/crds). Do not edit.\n"
    files = {
        f"{GROUP}_{k.plural}.yaml": header + yaml.safe_dump(crd(k), sort_keys=False, width=100) for k in KINDS
    }
    files["kopf.dev_clusterkopfpeerings.yaml"] = header + yaml.safe_dump(PEERING_CRD, sort_keys=False)
    return files


# kopf's peering object: replicas of the operator see each other here and only the top priority acts.
PEERING_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "clusterkopfpeerings.kopf.dev"},
    "spec": {
        "group": "kopf.dev",
        "scope": "Cluster",
        "names": {
            "kind": "ClusterKopfPeering",
            "plural": "clusterkopfpeerings",
            "singular": "clusterkopfpeering",
        },
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                        },
                    }
                },
            }
        ],
    },
}


def write(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render_all().items():
        path = directory / name
        path.write_text(text)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directories", type=Path, nargs="+", help="e.g. charts/keepwarm/crds/")
    args = parser.parse_args(argv)
    for directory in args.directories:
        for path in write(directory):
            print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
