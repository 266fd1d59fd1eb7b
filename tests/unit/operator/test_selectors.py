"""metav1.LabelSelector semantics of keepwarm_api's LabelSelector (WeightCache.spec.allowedNamespaces)."""

import pytest

from keepwarm_api.common import LabelSelector
from keepwarm_api.weightcache import WeightCacheSpec

NS = {"kubernetes.io/metadata.name": "team-a", "tier": "prod"}


@pytest.mark.parametrize(
    ("selector", "matches"),
    [
        ({}, True),  # empty selector: everything
        ({"matchLabels": {"tier": "prod"}}, True),
        ({"matchLabels": {"tier": "dev"}}, False),
        (
            {
                "matchExpressions": [
                    {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["team-a", "b"]}
                ]
            },
            True,
        ),
        (
            {
                "matchExpressions": [
                    {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["team-a"]}
                ]
            },
            False,
        ),
        ({"matchExpressions": [{"key": "missing", "operator": "NotIn", "values": ["x"]}]}, True),
        ({"matchExpressions": [{"key": "tier", "operator": "Exists"}]}, True),
        ({"matchExpressions": [{"key": "tier", "operator": "DoesNotExist"}]}, False),
        ({"matchLabels": {"tier": "prod"}, "matchExpressions": [{"key": "x", "operator": "Exists"}]}, False),
    ],
)
def test_label_selector_matches_like_kubernetes(selector, matches):
    assert LabelSelector.model_validate(selector).matches(NS) is matches


def test_allowed_namespaces_is_unset_by_default():
    spec = WeightCacheSpec.model_validate({"models": [{"name": "m", "source": {"path": "/m"}}]})
    assert spec.allowed_namespaces is None
