"""The chart's tenancy policies (charts/keepwarm/templates/tenancy-policy.yaml) on the real API server.

No operator runs here: the refusals come from the kube-apiserver's ValidatingAdmissionPolicy plugin
alone, at create time. The namespace policy's CEL selector is checked against the operator's own
selector semantics (keepwarm_api LabelSelector.matches), so the two checks cannot drift apart.
Policies and their WeightCache params reach the API server's informers asynchronously, so each test
first waits until the policy is seen to act (a server-side dry run), then asserts on real requests.
"""

from __future__ import annotations

import json
import uuid

import pytest
import yaml

from keepwarm_api.common import LabelSelector
from keepwarm_testing.operator import install_chart_rbac, install_crds, wait

pytestmark = pytest.mark.slow
TENANT = "keepwarm-e2e/tenant"  # a namespace label the selectors below read
PREFIX = "/var/lib/models"  # the chart's default tenancyPolicy.inlinePathPrefix


@pytest.fixture(scope="module")
def cluster(control_plane):
    cp = control_plane
    install_crds(cp)
    install_chart_rbac(cp)  # the chart's admission policies come with it
    tag = f"ten{uuid.uuid4().hex[:5]}"
    labels = {f"{tag}-gold": {TENANT: "gold"}, f"{tag}-lead": {TENANT: "lead"}, f"{tag}-bare": {}}
    for ns, extra in labels.items():
        cp.kubectl("create", "namespace", ns)
        if extra:
            cp.kubectl("label", "namespace", ns, *(f"{k}={v}" for k, v in extra.items()))
    # Every namespace carries kubernetes.io/metadata.name, as the API server sets it.
    namespaces = {ns: {**extra, "kubernetes.io/metadata.name": ns} for ns, extra in labels.items()}
    yield cp, tag, namespaces
    for ns in namespaces:
        cp.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def inference(name: str, ns: str, model: dict) -> dict:
    return {
        "apiVersion": "keepwarm.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"model": model, "replicas": 0},
    }


def weightcache(name: str, allowed: dict | None) -> dict:
    spec: dict = {"models": [{"name": "tiny", "source": {"path": f"{PREFIX}/tiny"}}]}
    if allowed is not None:
        spec["allowedNamespaces"] = allowed
    return {
        "apiVersion": "keepwarm.dev/v1alpha1",
        "kind": "WeightCache",
        "metadata": {"name": name},
        "spec": spec,
    }


def create(cp, doc: dict, *, dry_run: bool = False):
    args = ["create", "-f", "-", *(["--dry-run=server"] if dry_run else [])]
    return cp.kubectl(*args, input=yaml.safe_dump(doc), check=False)


def refused_once_seen(cp, doc: dict, what: str) -> None:
    """Wait until the API server refuses doc (dry run): the policy and its params have reached it."""
    wait(cp, lambda: create(cp, doc, dry_run=True).returncode != 0, what, timeout_s=60)


SELECTORS = {
    "labels": {"matchLabels": {TENANT: "gold"}},
    "in": {"matchExpressions": [{"key": TENANT, "operator": "In", "values": ["gold", "silver"]}]},
    "not-in": {"matchExpressions": [{"key": TENANT, "operator": "NotIn", "values": ["lead"]}]},
    "exists": {"matchExpressions": [{"key": TENANT, "operator": "Exists"}]},
    "does-not-exist": {"matchExpressions": [{"key": TENANT, "operator": "DoesNotExist"}]},
    "both": {
        "matchLabels": {TENANT: "lead"},
        "matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "Exists"}],
    },
}


@pytest.mark.parametrize("case", sorted(SELECTORS))
def test_a_namespace_outside_allowed_namespaces_is_refused_by_the_api_server(cluster, case):
    cp, tag, namespaces = cluster
    cache = f"{tag}-{case}"
    selector = SELECTORS[case]
    cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(weightcache(cache, selector)))
    expected = {ns: LabelSelector.model_validate(selector).matches(lbl) for ns, lbl in namespaces.items()}
    assert set(expected.values()) == {True, False}  # each case admits one namespace and refuses one
    model = {"cacheRef": cache, "name": "tiny"}
    outside = next(ns for ns, ok in expected.items() if not ok)
    refused_once_seen(cp, inference("probe", outside, model), f"the policy judges WeightCache {cache}")
    try:
        for ns, allowed in expected.items():
            result = create(cp, inference("chat", ns, model))
            if allowed:
                assert result.returncode == 0, (ns, result.stderr)
            else:
                assert result.returncode != 0, f"{ns} was admitted to {cache}"
                assert (
                    f"namespace {ns} is not selected by spec.allowedNamespaces of WeightCache {cache}"
                    in result.stderr
                ), result.stderr
                assert "ValidatingAdmissionPolicy" in result.stderr, result.stderr
    finally:
        for ns in namespaces:
            cp.kubectl("delete", "idep", "chat", "-n", ns, "--ignore-not-found", check=False)
        cp.kubectl("delete", "wc", cache, check=False)


def test_caches_without_a_selector_and_other_caches_are_not_judged(cluster):
    """A cache with no allowedNamespaces admits every namespace, even while a strict cache exists."""
    cp, tag, _ = cluster
    strict, open_ = f"{tag}-strict", f"{tag}-open"
    cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(weightcache(strict, SELECTORS["labels"])))
    cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(weightcache(open_, None)))
    bare = f"{tag}-bare"
    strict_ref = {"cacheRef": strict, "name": "tiny"}
    refused_once_seen(cp, inference("probe", bare, strict_ref), f"the policy judges WeightCache {strict}")
    try:
        result = create(cp, inference("chat", bare, {"cacheRef": open_, "name": "tiny"}))
        assert result.returncode == 0, result.stderr
        missing = create(cp, inference("lost", bare, {"cacheRef": f"{tag}-none", "name": "tiny"}))
        assert missing.returncode == 0, missing.stderr  # no such cache: the operator says CacheNotFound
        # Changing the model to the strict cache is judged like a create.
        patch = json.dumps({"spec": {"model": {"cacheRef": strict}}})
        changed = cp.kubectl("patch", "idep", "chat", "-n", bare, "--type=merge", "-p", patch, check=False)
        assert changed.returncode != 0 and "is not selected by spec.allowedNamespaces" in changed.stderr
        # Writes that leave spec.model alone (the operator's finalizers, a label) are not judged.
        labelled = cp.kubectl("label", "idep", "chat", "-n", bare, "team=a", check=False)
        assert labelled.returncode == 0, labelled.stderr
    finally:
        for name in ("chat", "lost"):
            cp.kubectl("delete", "idep", name, "-n", bare, "--ignore-not-found", check=False)
        cp.kubectl("delete", "wc", strict, open_, check=False)


@pytest.mark.parametrize(
    ("path", "admitted"),
    [
        (f"{PREFIX}/tiny", True),
        (PREFIX, True),
        ("/etc/kubernetes", False),
        ("/var/lib/modelsX/tiny", False),
        (f"{PREFIX}/../../etc", False),
        (f"{PREFIX}/./tiny", False),
        ("/", False),
    ],
)
def test_an_inline_path_outside_the_prefix_is_refused_by_the_api_server(cluster, path, admitted):
    cp, tag, _ = cluster
    ns = f"{tag}-bare"
    refused_once_seen(cp, inference("probe", ns, {"source": {"path": "/etc"}}), "the inline-path policy acts")
    result = create(cp, inference("disk", ns, {"source": {"path": path}}))
    try:
        if admitted:
            assert result.returncode == 0, result.stderr
        else:
            assert result.returncode != 0, f"{path} was admitted"
            assert f"source.path {path} must lie under {PREFIX}" in result.stderr, result.stderr
    finally:
        cp.kubectl("delete", "idep", "disk", "-n", ns, "--ignore-not-found", check=False)


SNAPSHOT_LABEL = (
    "keepwarm.dev/snapshot-startup"  # the chart's default tenancyPolicy.snapshotStartupNamespaceLabel
)


def test_snapshot_startup_is_admitted_only_in_namespaces_the_admin_labelled(cluster):
    """spec.startup.mode Snapshot gives runtime pods CHECKPOINT_RESTORE and SETPCAP: the API server
    refuses it outside namespaces carrying the chart's label; Imports is admitted anywhere."""
    cp, tag, _ = cluster
    labelled, bare = f"{tag}-snap", f"{tag}-bare"
    cp.kubectl("create", "namespace", labelled)
    cp.kubectl("label", "namespace", labelled, f"{SNAPSHOT_LABEL}=yes")

    def doc(name: str, ns: str, mode: str) -> dict:
        body = inference(name, ns, {"source": {"path": f"{PREFIX}/tiny"}})
        body["spec"]["startup"] = {"mode": mode}
        return body

    try:
        refused_once_seen(cp, doc("probe", bare, "Snapshot"), "the snapshot-startup policy acts")
        refused = create(cp, doc("snap", bare, "Snapshot"))
        assert refused.returncode != 0
        assert f"needs namespace {bare} to carry the label {SNAPSHOT_LABEL}" in refused.stderr, refused.stderr
        assert create(cp, doc("snap", labelled, "Snapshot")).returncode == 0
        assert create(cp, doc("plain", bare, "Imports")).returncode == 0
    finally:
        cp.kubectl("delete", "idep", "plain", "-n", bare, "--ignore-not-found", check=False)
        cp.kubectl("delete", "namespace", labelled, "--wait=false", check=False)
