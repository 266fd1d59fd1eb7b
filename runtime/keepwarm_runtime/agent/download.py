"""Hub downloads the node agent can end: snapshot_download in a child process, killed when it stalls.

huggingface_hub has no overall deadline (its API calls wait without a timeout) and a thread cannot be
stopped, so a process is the unit of cancellation. Progress is what reaches the disk: the bytes under
the repository's cache directory (blobs grow while they download). A download that adds nothing for
`stall_s` seconds is killed and fails as DownloadStalled; one that keeps moving may take as long as
it needs. The token reaches the child through its environment (HF_TOKEN), never a command line.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

POLL_S = 0.5  # how often progress is measured
# The child: download, print the snapshot directory on the last line.
_CHILD = (
    "import sys\n"
    "from huggingface_hub import snapshot_download\n"
    "print(snapshot_download(sys.argv[1], revision=sys.argv[2], cache_dir=sys.argv[3]))\n"
)


class DownloadStalled(TimeoutError):
    """The download added no bytes for the stall timeout (a hung connection or server)."""


class DownloadFailed(RuntimeError):
    """snapshot_download raised (the last line of its error is the message)."""


def repo_cache_dir(cache_dir: str | Path, repo: str) -> Path:
    """huggingface_hub's directory for one model repository under cache_dir."""
    return Path(cache_dir) / f"models--{repo.replace('/', '--')}"


def bytes_on_disk(path: Path) -> int:
    """Total size of the files under path (0 while it does not exist)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:  # renamed from .incomplete meanwhile
                continue
    return total


def download(repo: str, revision: str, cache_dir: str, token: str | None, stall_s: float) -> str:
    """The local snapshot directory of repo@revision; DownloadStalled or DownloadFailed otherwise."""
    env = {**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    if token:
        env["HF_TOKEN"] = token
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, repo, revision, cache_dir],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    watched = repo_cache_dir(cache_dir, repo)
    seen, moved_at = -1, time.monotonic()
    while True:
        try:
            out, err = proc.communicate(timeout=POLL_S)
            break
        except subprocess.TimeoutExpired:
            size = bytes_on_disk(watched)
            if size != seen:
                seen, moved_at = size, time.monotonic()
            elif time.monotonic() - moved_at > stall_s:
                proc.kill()
                proc.communicate()
                raise DownloadStalled(
                    f"download of {repo}@{revision} made no progress for {stall_s:g} s; stopped"
                ) from None
    if proc.returncode != 0:
        lines = [line for line in err.strip().splitlines() if line.strip()]
        raise DownloadFailed(lines[-1] if lines else f"snapshot_download exited {proc.returncode}")
    return out.strip().splitlines()[-1]
