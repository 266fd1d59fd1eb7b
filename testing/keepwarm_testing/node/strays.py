"""What an earlier test cluster left running when it was killed before its teardown (SIGKILL, a
terminal closed, an interrupt during a pull): its add-ons (the LeaderWorkerSet controller, CoreDNS),
kubelets, kube-proxy, containerd and shims, the registry, and the pods' processes. A containerd left
on a node's persistent root holds its database, so the next cluster's containerd for that node waits
on it and never starts; a CoreDNS left holds port 53 on an address the next bridge may take.

`stop_strays()` runs with the machine lock held (node/cluster.py), so nothing it finds belongs to a
live cluster: it kills them, removes the nodes' emptied cgroup roots and unmounts what was mounted in
the dead cluster's node folders.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

from .kubelet import CGROUP_FS, remove_cgroup_root

CACHE = Path.home() / ".cache" / "keepwarm"
# Stopped in this order (node/build.sh's names).
COMPONENTS = ("lws-manager", "kubelet", "kube-proxy", "containerd", "containerd-shim-runc-v2", "coredns")
CGROUP_PREFIX = "kwt-"  # a node's cgroupRoot is /kwt-<node> (node/kubelet.py)


def _processes() -> list[tuple[int, str, str]]:
    """(pid, executable, command line) of every process this user can read."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            exe = os.readlink(entry / "exe")
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            found.append((int(entry.name), exe, cmdline))
    return found


def stray_components() -> list[tuple[int, str]]:
    """(pid, name) of node components built into the cache and of registries serving a test cluster."""
    strays = []
    for pid, exe, cmdline in _processes():
        name = os.path.basename(exe)
        ours = name in COMPONENTS and exe.startswith(str(CACHE))
        if ours or (name == "docker-registry" and "keepwarm-cp-" in cmdline):
            strays.append((pid, name))
    return sorted(strays, key=lambda s: COMPONENTS.index(s[1]) if s[1] in COMPONENTS else len(COMPONENTS))


def pod_cgroup_roots() -> list[str]:
    """The nodes' cgroup roots (/kwt-<node>) that exist in any cgroup v1 hierarchy."""
    roots = set()
    for hierarchy in CGROUP_FS.iterdir() if CGROUP_FS.is_dir() else []:
        roots |= {f"/{p.name}" for p in hierarchy.glob(f"{CGROUP_PREFIX}*") if p.is_dir()}
    return sorted(roots)


def pids_in(root: str) -> set[int]:
    """Every process in cgroup `root` or below it, in any hierarchy."""
    pids: set[int] = set()
    for hierarchy in CGROUP_FS.iterdir():
        for procs in (hierarchy / root.lstrip("/")).rglob("cgroup.procs"):
            with contextlib.suppress(OSError):
                pids |= {int(pid) for pid in procs.read_text().split()}
    return pids


def _kill_and_wait(pids: set[int], timeout_s: float = 10.0) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)  # a killed containerd lets go of its database only once it is gone


def stop_strays() -> list[str]:
    """Kill what an earlier cluster left (components first, then every process in the nodes' cgroups)
    and remove those cgroups; returns what was found, for the log."""
    components = stray_components()
    _kill_and_wait({pid for pid, _ in components})
    found = [f"{name} (pid {pid})" for pid, name in components]
    for root in pod_cgroup_roots():
        pods = pids_in(root)
        _kill_and_wait(pods)
        remove_cgroup_root(root)
        found.append(f"cgroup {root} ({len(pods)} processes)")
    for mount in stray_mounts():
        subprocess.run(["umount", "--lazy", mount], check=False, capture_output=True)
        found.append(f"mount {mount}")
    return found


def stray_mounts() -> list[str]:
    """Mount points inside a test cluster's node folders (the kubelet's root, pods' volumes), deepest
    first."""
    points = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            point = line.split()[4].replace("\\040", " ")
            if "/keepwarm-cp-" in point and "/nodes/" in point:
                points.append(point)
    return sorted(points, key=lambda p: p.count("/"), reverse=True)
