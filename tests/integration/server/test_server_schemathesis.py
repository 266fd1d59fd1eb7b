"""Schemathesis fuzzes every operation in the server's own /openapi.json: no 5xx, healthy after.

Bounded: the fuzzing phase only, a fixed seed and a few examples per operation (the coverage phase
finds the same classes of bug but takes ~10 minutes on a 2-core box; run it by hand with
``st run URL/openapi.json --checks not_a_server_error``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.integration.server.conftest import engine_is_idle

EXAMPLES_PER_OPERATION = 12


def test_fuzzing_the_openapi_schema_finds_no_server_errors(served, tmp_path):
    st = shutil.which("st", path=str(Path(sys.executable).parent))
    if st is None:
        pytest.fail("schemathesis is missing: it is in requirements-dev.txt (make venv)")
    command = [st, "run", served.proc.url + "/openapi.json", "--checks", "not_a_server_error"]
    command += ["--phases", "examples,fuzzing", "--max-examples", str(EXAMPLES_PER_OPERATION)]
    command += ["--seed", "7", "--request-timeout", "120", "--workers", "1", "--no-color"]
    # cwd: schemathesis keeps a crash cache in ./.schemathesis; keep it out of the checkout
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-4000:]
    assert "generated" in result.stdout and "passed" in result.stdout
    assert httpx.get(served.proc.url + "/health").status_code == 200
    stats = engine_is_idle(served.proc)
    assert (stats["num_running"], stats["num_waiting"], stats["kv_cache_usage"]) == (0, 0, 0)
