"""CRDs generated from the pydantic models: committed YAML must match, and be structural."""

from pathlib import Path

import yaml

from keepwarm_api.crdgen import KINDS, crd, render_all

ROOT = Path(__file__).resolve().parents[3]


CRDS = ROOT / "charts" / "keepwarm" / "crds"  # the one committed home of the generated CRDs


def test_committed_crds_match_models():
    rendered = render_all()
    assert sorted(p.name for p in CRDS.glob("*.yaml")) == sorted(rendered), "run `make crds` and commit"
    for name, text in rendered.items():
        path = CRDS / name
        assert path.read_text() == text, f"{path} drifted from the models: run `make crds` and commit"


def _walk(node, where="$"):
    if isinstance(node, dict):
        yield where, node
        for key, value in node.items():
            yield from _walk(value, f"{where}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, f"{where}[{i}]")


def test_schemas_are_structural():
    for kind in KINDS:
        schema = crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        for where, node in _walk(schema):
            assert "$ref" not in node and "title" not in node, where
            if "properties" in node or "items" in node:
                assert node.get("type") in ("object", "array"), f"{kind.kind} {where} has no type"
            if "anyOf" in node:
                assert node.get("x-kubernetes-int-or-string"), (
                    f"{kind.kind} {where}: anyOf outside int-or-string"
                )
            assert node.get("default", "") is not None, f"{kind.kind} {where}: null default"


def test_inferencedeployment_has_scale_and_columns():
    doc = yaml.safe_load(render_all()["keepwarm.dev_inferencedeployments.yaml"])
    version = doc["spec"]["versions"][0]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    assert doc["spec"]["names"]["shortNames"] == ["idep"]
    assert doc["spec"]["scope"] == "Namespaced"
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["properties"]["replicas"]["default"] == 1
    assert spec["properties"]["model"]["x-kubernetes-validations"]


def test_weightcache_defaults_enums_and_cel():
    doc = yaml.safe_load(render_all()["keepwarm.dev_weightcaches.yaml"])
    assert doc["spec"]["scope"] == "Cluster" and doc["spec"]["names"]["shortNames"] == ["wc"]
    spec = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["properties"]["tier"]["enum"] == ["gpu", "host"]
    assert spec["properties"]["socket"]["default"] == {}
    assert spec["properties"]["socket"]["properties"]["mode"]["default"] == "0770"
    rules = [v["rule"] for v in spec["x-kubernetes-validations"]]
    assert any("dtype" in r for r in rules) and not any("quantization" in r for r in rules)
    models = spec["properties"]["models"]
    assert models["x-kubernetes-list-type"] == "map"
    assert models["items"]["properties"]["source"]["x-kubernetes-validations"]
    assert spec["properties"]["models"]["items"]["properties"]["name"]["description"]
