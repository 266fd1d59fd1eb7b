"""What one device call sends, and whether it fits: the working tree plus the carried paths, ≤ 64 MiB.

The device tool sends tracked files and untracked files git does not ignore (measured here with
`git ls-files`), plus each carried ignored path whole. Every call re-sends the tree, so a plan that
needs several calls pays it in each.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CallPlan:
    carry: list[str]  # paths relative to the repository root
    tree_bytes: int  # the working tree, sent with every call
    carry_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.tree_bytes + self.carry_bytes


def tree_bytes(repo: Path) -> int:
    """Bytes of the files a device call sends besides the carried paths."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=repo,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    total = 0
    for name in filter(None, listed):
        path = repo / name.decode()
        if path.is_symlink() or path.is_file():  # deleted-but-tracked files are not sent
            total += path.lstat().st_size
    return total


def path_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def plan_calls(tree: int, carried: dict[str, int], limit: int) -> list[CallPlan]:
    """Carried paths packed into as few calls as fit `limit` each (first fit, largest first).

    Raises ValueError naming a path that cannot fit even alone beside the tree.
    """
    calls: list[list[tuple[str, int]]] = []
    for path, size in sorted(carried.items(), key=lambda item: -item[1]):
        if tree + size > limit:
            raise ValueError(
                f"{path} ({size / 2**20:.1f} MiB) does not fit one call beside the working tree "
                f"({tree / 2**20:.1f} MiB) under {limit / 2**20:.0f} MiB: split it"
            )
        for call in calls:
            if tree + sum(s for _, s in call) + size <= limit:
                call.append((path, size))
                break
        else:
            calls.append([(path, size)])
    return [CallPlan([p for p, _ in c], tree, sum(s for _, s in c)) for c in calls] or [CallPlan([], tree, 0)]
