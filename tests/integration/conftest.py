"""Session fixture `control_plane`: one real Kubernetes control plane (keepwarm_testing) on loopback,
shared by the operator and the observability tests.

The binaries come from keepwarm_testing/controlplane/build.sh's cache (`make test` builds it first, so a cold
build does not eat a test's timeout). A build failure fails the tests with the build log's tail;
there is no fallback to a fake API.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from keepwarm_testing.controlplane.cluster import ControlPlane


@pytest.fixture(scope="session")
def control_plane(request: pytest.FixtureRequest) -> Iterator[ControlPlane]:
    """etcd + kube-apiserver (RBAC) + controller-manager + scheduler + fake-kubelet; no nodes yet.

    keepwarm_testing is imported here, not at the top: tests/integration/engine runs as the GPU dry
    run's CPU twin (scripts/gpu-check --dry-run --smoke), under the GPU image's packages, without it."""
    from keepwarm_testing.controlplane.build import ControlPlaneBuildError, build_control_plane
    from keepwarm_testing.controlplane.cluster import ControlPlane

    try:
        bin_dir = build_control_plane()
    except ControlPlaneBuildError as exc:
        pytest.fail(str(exc), pytrace=False)
    cp = ControlPlane(bin_dir)
    try:
        cp.start()
    except BaseException:
        cp.stop(failed=True)
        raise
    yield cp
    cp.stop(failed=request.session.testsfailed > 0)
