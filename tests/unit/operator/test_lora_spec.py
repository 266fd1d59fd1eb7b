"""InferenceDeployment spec.lora: what the models refuse, and that the generated CRD makes the API
server refuse the same (its CEL rules are exercised on a real API server in
tests/integration/operator/test_operator_e2e.py)."""

import pytest
import yaml
from pydantic import ValidationError

from keepwarm_api.crdgen import render_all
from keepwarm_api.inferencedeployment import InferenceDeploymentSpec

PVC = {"pvc": {"claimName": "adapters"}}


def spec(lora: dict) -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.model_validate({"model": {"cacheRef": "wc", "name": "base"}, "lora": lora})


def test_a_good_lora_section_parses_with_defaults():
    lora = spec({"adapters": [{"name": "sql", "source": PVC}]}).lora
    assert lora is not None and lora.enabled and not lora.allow_runtime_updating
    assert (lora.max_loras, lora.max_lora_rank) == (None, None)
    assert lora.adapters[0].source.pvc.claim_name == "adapters"


@pytest.mark.parametrize(
    ("lora", "message"),
    [
        ({"adapters": [{"name": "a", "source": PVC}] * 2}, "'a' appears twice"),
        ({"adapters": [{"name": "Bad_Name", "source": PVC}]}, "should match pattern"),
        ({"adapters": [{"name": "a" * 59, "source": PVC}]}, "at most 58 characters"),
        ({"maxLoras": 0}, "greater than or equal to 1"),
        ({"maxLoraRank": 1024}, "less than or equal to 512"),
        ({"adapters": [{"name": "a", "source": {"containerPath": "relative/dir"}}]}, "should match pattern"),
    ],
    ids=["duplicate-name", "name-syntax", "name-too-long", "no-slots", "rank-too-high", "relative-path"],
)
def test_bad_lora_sections_are_refused_naming_the_problem(lora, message):
    with pytest.raises(ValidationError, match=message):
        spec(lora)


def test_the_crd_carries_the_same_constraints_for_the_api_server():
    doc = yaml.safe_load(render_all()["keepwarm.dev_inferencedeployments.yaml"])
    schema = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    lora = schema["properties"]["spec"]["properties"]["lora"]["properties"]
    assert (lora["maxLoras"]["minimum"], lora["maxLoraRank"]["maximum"]) == (1, 512)
    adapters = lora["adapters"]
    assert adapters["x-kubernetes-list-type"] == "map" and adapters["x-kubernetes-list-map-keys"] == ["name"]
    item = adapters["items"]["properties"]
    assert item["name"]["maxLength"] == 58 and item["name"]["pattern"].startswith("^[a-z0-9]")
    (one_source,) = item["source"]["x-kubernetes-validations"]
    assert "exactly one of source.cached, source.pvc, source.containerPath" in one_source["message"]
    assert any("served model's name" in v["message"] for v in schema["x-kubernetes-validations"])
