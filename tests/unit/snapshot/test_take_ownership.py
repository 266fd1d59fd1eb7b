"""snapshot/take.py hands the temporary directory to the pod's uid and takes it back, as the node agent
runs: root with CHOWN and FOWNER but neither DAC_OVERRIDE nor DAC_READ_SEARCH (its pod's capabilities).
Found on the real node: chowning the directory before its contents locked root out of it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="root and setpriv: capabilities are dropped"
)

AS_THE_AGENT = ["setpriv", "--bounding-set=-all,+chown,+fowner", "--inh-caps=-all", "--"]
SCRIPT = """
import os, sys
from pathlib import Path
from keepwarm_runtime.snapshot.take import hand_over, reclaim
temp = Path(sys.argv[1])
for name in ("images", "work"):
    (temp / name).mkdir(mode=0o700)
(temp / "work" / "config.json").write_text("{}")
(temp / "images" / "pages-1.img").write_bytes(b"x" * 10)
os.chmod(temp / "images" / "pages-1.img", 0o600)
hand_over(temp, 10001, 10001)
try:
    os.listdir(temp)
    locked_out = False
except PermissionError:
    locked_out = True
reclaim(temp)
print(locked_out, (temp / "images" / "pages-1.img").read_bytes() == b"x" * 10, sorted(os.listdir(temp)))
"""


def test_the_pods_uid_gets_every_file_and_root_takes_them_back_without_dac_override(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir(mode=0o755)
    temp = store / ".tmp-key-1-0"
    temp.mkdir(mode=0o700)
    proc = subprocess.run(
        [*AS_THE_AGENT, sys.executable, "-c", SCRIPT, str(temp)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    # Handed over, the directory is the pod's alone (root without DAC_* cannot list it); reclaimed,
    # root reads what was written in it.
    assert proc.stdout.split("\n")[0] == "True True ['images', 'work']"
    assert all(p.stat().st_uid == 0 for p in [temp, *temp.rglob("*")])
