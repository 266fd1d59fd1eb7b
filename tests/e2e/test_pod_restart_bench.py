"""bench/pod_restart.py runs end to end on real nodes, case after case (root only).

Numbers are not checked (speed belongs to the benchmark); what is checked is that every case runs after
the one before (the pod a `delete` leaves is still in its preStop sleep when the next case starts), the
warm pod lands on the warm node, and each run carries the fields the README's table reads. It runs the
`snapshot` mode, the warm node with process snapshots on: the first pod imports and the node agent takes
the snapshot (CRIU in the runtime image, as the node agent and a pod's restore run it under runc), and
every case's new pod is restored from it (docs/snapshots.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.running_pods import ON_REAL_NODES

pytestmark = ON_REAL_NODES
REPO = Path(__file__).resolve().parents[2]
CASES = ["delete", "crash", "scale_from_zero"]


def test_pod_restart_bench_runs_every_case_in_a_row(tmp_path: Path) -> None:
    out = tmp_path / "pod_restart.json"
    argv = [sys.executable, "bench/pod_restart.py", "--params", "1M", "--cases", ",".join(CASES)]
    proc = subprocess.run(
        [*argv, "--modes", "snapshot", "--json-out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert [run["case"] for run in result["runs"]] == CASES
    for run in result["runs"]:
        assert run["mode"] == "snapshot" and run["node"] == result["warm_node"], run
        assert run["startup_source"] == "snapshot/hit" and run["restore_s"] > 0, run
        assert 0 < run["pod_ready_s"] <= run["first_token_s"], run
        assert 0 <= run["container_start_s"] < run["pod_ready_s"], run
        for key in ("parent_imports_s", "process_ready_s", "ready_lag_s"):
            assert isinstance(run[key], float), (key, run)
        assert "weights" in run["phases"], run
        assert 0 < run["first_request_server_s"] < run["first_token_s"] - run["pod_ready_s"], run
