"""Module fixture `e2e_cluster`: each e2e module gets its own control plane that runs pods for real
(keepwarm_testing.e2e.pod_cluster), with a model on its one node."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from keepwarm_testing.controlplane.build import ControlPlaneBuildError
from keepwarm_testing.e2e import pod_cluster


@pytest.fixture(scope="module")
def e2e_cluster(request: pytest.FixtureRequest) -> Iterator[SimpleNamespace]:
    """(cp, node, root); the steps of a module share it and may add attributes to it."""
    try:
        with pod_cluster(lambda: request.session.testsfailed > 0) as cluster:
            yield cluster
    except ControlPlaneBuildError as exc:
        pytest.fail(str(exc), pytrace=False)
