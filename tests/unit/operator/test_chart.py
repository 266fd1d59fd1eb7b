"""The Helm chart, rendered and linted by the real Helm library, checked with kubernetes-validate."""

import subprocess
import sys
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from keepwarm_api.inferencedeployment import InferenceDeploymentSpec
from keepwarm_api.weightcache import WeightCacheSpec
from keepwarm_operator.builders.agent import agent_children
from keepwarm_operator.builders.meta import agent_name
from keepwarm_operator.builders.runtime import CacheBinding, runtime_deployment, runtime_service

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "charts" / "keepwarm"
VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
KUBE_VERSIONS = ["1.30.0", "1.37.0"]
NOT_CORE = {"ServiceMonitor", "PodMonitor", "ClusterKopfPeering"}  # CRs: no schema in kubernetes-validate


def render(values_file: Path) -> list[dict]:
    values = yaml.safe_load(values_file.read_text()) or {}
    out = helm.Chart.load(CHART).render(values, name="kw", namespace="keepwarm-system", is_install=True)
    docs = []
    for name, text in sorted(out.items()):
        if name.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def crds() -> list[dict]:
    return [yaml.safe_load(c["data"]) for c in helm.Chart.load(CHART).crds]


@pytest.mark.parametrize("values_file", VALUES, ids=lambda p: p.stem)
@pytest.mark.parametrize("kube", KUBE_VERSIONS)
def test_chart_lints_strict(values_file, kube):
    values = yaml.safe_load(values_file.read_text()) or {}
    report = helm.lint(CHART, values, strict=True, kube_version=f"v{kube}", namespace="keepwarm-system")
    assert report["errors"] == [], report
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


@pytest.mark.parametrize("values_file", VALUES, ids=lambda p: p.stem)
@pytest.mark.parametrize("kube", KUBE_VERSIONS)
def test_every_manifest_validates_strict(values_file, kube):
    docs = render(values_file) + crds()
    assert docs
    for doc in docs:
        if doc["kind"] in NOT_CORE:
            continue
        kubernetes_validate.validate(doc, kube, strict=True)


def test_values_files_change_what_renders():
    kinds = {v.stem: sorted(d["kind"] for d in render(v)) for v in VALUES}
    assert "ServiceMonitor" in kinds["full-values"] and "ConfigMap" in kinds["full-values"]
    assert "ServiceAccount" not in kinds["minimal-values"] and "ClusterRole" not in kinds["minimal-values"]
    assert kinds["default-values"] == sorted(
        [
            "ClusterKopfPeering",
            "ClusterRole",
            "ClusterRoleBinding",
            "Deployment",
            "Role",
            "RoleBinding",
            "Service",
            "ServiceAccount",
            *["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"] * 4,
        ]
    )  # fmt: skip (agent-own-node, cache-namespaces, inline-path, snapshot-startup)
    assert "ValidatingAdmissionPolicy" not in kinds["minimal-values"]
    full = next(d for d in render(CHART / "ci" / "full-values.yaml") if d["kind"] == "Deployment")
    args = full["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--agent-namespace=keepwarm-agents" in args


def test_kubernetes_validate_cli_on_rendered_chart(tmp_path):
    docs = [d for d in render(CHART / "ci" / "full-values.yaml") if d["kind"] not in NOT_CORE] + crds()
    path = tmp_path / "all.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    for kube in KUBE_VERSIONS:
        cli = [sys.executable, "-m", "kubernetes_validate", "--strict", "-k", kube, str(path)]
        result = subprocess.run(cli, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr


def _rules_cover(granted: list[dict], rule: dict) -> bool:
    for verb in rule["verbs"]:
        for resource in rule["resources"]:
            if not any(
                set(rule["apiGroups"]) <= set(g["apiGroups"])
                and resource in g["resources"]
                and verb in g["verbs"]
                and not g.get("resourceNames")
                for g in granted
            ):
                return False
    return True


def test_operator_rbac_can_grant_the_agent_role():
    """RBAC escalation prevention: the operator may create only roles whose rules it holds itself."""
    docs = render(CHART / "ci" / "default-values.yaml")
    cluster = next(d for d in docs if d["kind"] == "ClusterRole")["rules"]
    in_agent_ns = cluster + next(d for d in docs if d["kind"] == "Role")["rules"]
    token = {"huggingFace": {"repo": "o/r", "revision": "abc", "tokenSecretRef": {"name": "t"}}}
    spec = WeightCacheSpec.model_validate({"models": [{"name": "m", "source": token}]})
    children = agent_children("c", spec, "ns", None)
    for kind, held in (("ClusterRole", cluster), ("Role", in_agent_ns)):
        agent_role = next(c for c in children if c["kind"] == kind)
        assert agent_role["rules"], kind
        for rule in agent_role["rules"]:
            assert _rules_cover(held, rule), rule


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
def test_builder_output_validates_strict(kube):
    """What the operator creates must be valid for every supported Kubernetes too."""
    cache = WeightCacheSpec.model_validate(
        {
            "models": [
                {"name": "a", "source": {"path": "/data/a"}},
                {"name": "b", "source": {"pvc": {"claimName": "models", "subPath": "b"}}},
                {
                    "name": "c",
                    "source": {
                        "huggingFace": {"repo": "o/r", "revision": "abc", "tokenSecretRef": {"name": "t"}}
                    },
                },
            ],
            "tolerations": [{"operator": "Exists"}],
            "budget": "10Gi",
            "agent": {"resources": {"limits": {"memory": "64Gi", "cpu": 2}}},
        }
    )
    owner = {
        "apiVersion": "keepwarm.dev/v1alpha1",
        "kind": "WeightCache",
        "metadata": {"name": "wc", "uid": "u"},
    }
    docs = agent_children("wc", cache, "keepwarm-system", owner)
    idep = InferenceDeploymentSpec.model_validate(
        {
            "model": {"cacheRef": "wc", "name": "c"},
            "env": [{"name": "A", "value": "1"}],
            "resources": {"requests": {"cpu": "500m"}},
            "pod": {"tolerations": [{"key": "k", "operator": "Exists"}]},
        }
    )
    binding = CacheBinding("wc", cache, cache.models[2])
    docs += [
        runtime_deployment("chat", "ns", idep, binding, owner),
        runtime_service("chat", "ns", idep, owner),
    ]
    for doc in docs:
        kubernetes_validate.validate(doc, kube, strict=True)


def test_agent_policy_matches_the_agents_the_operator_creates():
    """The policy names agents by the ServiceAccount prefix builders.meta.agent_name gives them."""
    policy = next(
        d
        for d in render(CHART / "ci" / "default-values.yaml")
        if d["kind"] == "ValidatingAdmissionPolicy" and d["metadata"]["name"].endswith("-agent-own-node")
    )
    (match,) = policy["spec"]["matchConditions"]
    assert f"system:serviceaccount:keepwarm-system:{agent_name('')}" in match["expression"]
    binding = next(
        d
        for d in render(CHART / "ci" / "default-values.yaml")
        if d["kind"] == "ValidatingAdmissionPolicyBinding"
        and d["spec"]["policyName"] == policy["metadata"]["name"]
    )
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}


def _inline_path_policy(prefix: str) -> dict:
    values = {"tenancyPolicy": {"inlinePathPrefix": prefix}}
    out = helm.Chart.load(CHART).render(values, name="kw", namespace="keepwarm-system", is_install=True)
    docs = [d for name, t in out.items() if name.endswith(".yaml") for d in yaml.safe_load_all(t) if d]
    return next(d for d in docs if d.get("metadata", {}).get("name") == "kw-keepwarm-inline-path")


@pytest.mark.parametrize(("prefix", "cel"), [("/data/models/", '"/data/models"'), ("", '""')])
def test_the_inline_path_prefix_reaches_the_policy_as_a_cel_string(prefix, cel):
    """A trailing slash is dropped (the rule adds one); empty refuses every inline path."""
    variables = {v["name"]: v["expression"] for v in _inline_path_policy(prefix)["spec"]["variables"]}
    assert variables["prefix"] == cel


@pytest.mark.parametrize("prefix", ["relative/dir", '/a"b', "/a/../b", "/a/."])
def test_an_inline_path_prefix_that_is_no_plain_directory_is_refused_by_name(prefix):
    with pytest.raises(Exception, match=r"tenancyPolicy\.inlinePathPrefix"):
        _inline_path_policy(prefix)


def test_operator_pod_names_its_kopf_identity():
    """kopf takes its peering identity from POD_ID, else from getpass.getuser(), which raises for the
    image's uid 65532 (no passwd entry): the operator pod exited at start until the chart set it."""
    (deployment,) = [d for d in render(VALUES[0]) if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == 65532


def _snapshot_policy(label: str | None) -> dict:
    values = {} if label is None else {"tenancyPolicy": {"snapshotStartupNamespaceLabel": label}}
    out = helm.Chart.load(CHART).render(values, name="kw", namespace="keepwarm-system", is_install=True)
    docs = [d for name, t in out.items() if name.endswith(".yaml") for d in yaml.safe_load_all(t) if d]
    return next(d for d in docs if d.get("metadata", {}).get("name") == "kw-keepwarm-snapshot-startup")


@pytest.mark.parametrize(
    ("label", "cel"), [(None, '"keepwarm.dev/snapshot-startup"'), ("", '""'), ("a/b", '"a/b"')]
)
def test_the_snapshot_startup_label_reaches_its_policy_as_a_cel_string(label, cel):
    """Default: namespaces labelled keepwarm.dev/snapshot-startup; empty refuses Snapshot startup."""
    policy = _snapshot_policy(label)
    variables = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}
    assert variables["label"] == cel
    assert "object.spec.startup.mode == 'Snapshot'" in policy["spec"]["matchConditions"][0]["expression"]
