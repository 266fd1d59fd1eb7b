"""`make test`'s preflight (scripts/test-preflight.sh): a checkout under a folder closed to other users
is refused in one line that names the folder; an open path passes."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "test-preflight.sh"


def preflight(cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT)], cwd=cwd, capture_output=True, text=True, check=False)


def test_a_checkout_under_a_closed_folder_is_refused_in_one_line(tmp_path: Path):
    tmp_path.chmod(0o755)
    home = tmp_path / "home"
    checkout = home / "src" / "keepwarm"
    checkout.mkdir(parents=True)
    home.chmod(0o700)
    try:
        done = preflight(checkout)
    finally:
        home.chmod(0o755)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and f"{home} (mode 700) is closed to other users" in done.stderr


def test_an_open_checkout_passes():
    # pytest's tmp_path sits under a folder of mode 0700: an open one of our own, in the system's
    with tempfile.TemporaryDirectory() as tmp:
        checkout = Path(tmp) / "keepwarm"
        checkout.mkdir()
        os.chmod(tmp, 0o755)
        done = preflight(checkout)
    assert done.returncode == 0, done.stderr
