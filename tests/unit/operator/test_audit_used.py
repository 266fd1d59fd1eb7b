"""The RBAC check reads the API server's audit log: only authorizer refusals count as missing grants."""

from __future__ import annotations

from keepwarm_testing.operator import AUTHZ_DECISION, used


def event(verb: str, code: int, decision: str, resource: str = "daemonsets", group: str = "apps") -> dict:
    """An audit event at Metadata level, shaped as kube-apiserver writes it."""
    return {
        "stage": "ResponseComplete",
        "verb": verb,
        "objectRef": {"resource": resource, "apiGroup": group, "namespace": "keepwarm-system"},
        "responseStatus": {"code": code},
        "annotations": {AUTHZ_DECISION: decision},
    }


def test_rbac_refusal_is_forbidden():
    allowed, forbidden = used([event("patch", 403, "forbid")])
    assert forbidden == {("patch", "apps", "daemonsets")} and not allowed


def test_quota_refusal_used_the_grant():
    """An exceeded ResourceQuota answers 403 after authorization allowed the request."""
    allowed, forbidden = used([event("patch", 403, "allow")])
    assert allowed == {("patch", "apps", "daemonsets")} and not forbidden


def test_apply_that_created_also_needed_create():
    allowed, _ = used([event("patch", 201, "allow", "services", "")])
    assert allowed == {("patch", "", "services"), ("create", "", "services")}
