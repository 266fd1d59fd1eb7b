"""A container's first process: enters the pod's namespaces, builds its root and runs the command.

    python -I init.py LAUNCH.json      (as root; standard library only, so `-I` keeps it fast)

What a container runtime does for one container, in this order:
  1. joins the pod's cgroup (every hierarchy) and network namespace;
  2. unshares mount, UTS, IPC and PID namespaces and forks: the child is PID 1 of the container, the
     parent stays as its shim (forwards SIGTERM/SIGINT/SIGHUP/SIGQUIT/SIGUSR1/SIGUSR2, exits with the
     child's status: 128+N for a signal, as a runtime reports it);
  3. the child builds the root: an overlay whose lower layer is the host's / (the host's installed
     software stands in for the image) and whose upper layer is a tmpfs (writes vanish with the
     container), pivots into it, mounts /proc, /sys (read-only), /dev with its own /dev/shm, an empty
     /tmp, then every volume at its mountPath (bind; read-only where asked), parents first;
  4. /root becomes traversable (mode 0711, in the upper layer only) because the image's Python lives
     under it on this machine; the working directory is created if missing; the root is remounted
     read-only for readOnlyRootFilesystem;
  5. sets the hostname and execs `setpriv`, which takes the uid, gid, supplementary groups,
     capability sets and no_new_privs, then execs the command with exactly the container's env.
A failure before the exec prints one line naming the step on stderr (the container log) and exits 128.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
SYS_PIVOT_ROOT = 155  # x86_64
PR_SET_PDEATHSIG = 1
OLD_ROOT = "/.kwt-old-root"
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)

libc = ctypes.CDLL(None, use_errno=True)


class SetupError(RuntimeError):
    pass


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(errno)}")


def mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(
        libc.mount(
            source.encode(),
            target.encode(),
            fstype.encode() if fstype else None,
            flags,
            data.encode() if data else None,
        ),
        f"mount {source} on {target}",
    )


def join_cgroups(procs_files: list[str]) -> None:
    for path in procs_files:
        with open(path, "w") as f:
            f.write(str(os.getpid()))


def enter_namespaces(netns: str | None) -> None:
    if netns:
        fd = os.open(netns, os.O_RDONLY)
        _check(libc.setns(fd, CLONE_NEWNET), f"setns {netns}")
        os.close(fd)
    _check(libc.unshare(CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWPID), "unshare")


def build_root(spec: dict) -> None:
    """Steps 3 and 4 of the module docstring."""
    mount("none", "/", None, MS_REC | MS_PRIVATE)
    scratch = spec["scratch"]
    mount("tmpfs", scratch, "tmpfs", 0, "mode=0755")
    for name in ("upper", "work", "root"):
        os.mkdir(f"{scratch}/{name}")
    mount(
        "overlay",
        f"{scratch}/root",
        "overlay",
        0,
        f"lowerdir=/,upperdir={scratch}/upper,workdir={scratch}/work",
    )
    root = f"{scratch}/root"
    os.makedirs(root + OLD_ROOT, exist_ok=True)
    _check(libc.syscall(SYS_PIVOT_ROOT, root.encode(), (root + OLD_ROOT).encode()), "pivot_root")
    os.chdir("/")
    old = OLD_ROOT
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    mount(f"{old}/sys", "/sys", None, MS_BIND)
    mount("none", "/sys", None, MS_BIND | MS_REMOUNT | MS_RDONLY)
    mount(f"{old}/dev", "/dev", None, MS_BIND | MS_REC)
    mount("shm", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    os.chmod("/root", 0o711)
    for m in sorted(spec["mounts"], key=lambda m: m["target"].rstrip("/").count("/")):
        source, target = old + m["source"], m["target"]
        if os.path.isdir(source):
            os.makedirs(target, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if not os.path.exists(target):
                open(target, "a").close()
        mount(source, target, None, MS_BIND | MS_REC)
        if m["read_only"]:
            mount("none", target, None, MS_BIND | MS_REMOUNT | MS_RDONLY)
    _check(libc.umount2(old.encode(), MNT_DETACH), f"umount {old}")
    os.rmdir(old)
    os.makedirs(spec["working_dir"], exist_ok=True)  # as runc does for an image's WORKDIR
    if spec["read_only_root"]:
        mount("none", "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY)


def setpriv_argv(spec: dict) -> list[str]:
    caps = ",".join(["-all", *(f"+{c.lower()}" for c in spec["capabilities"])])
    argv = ["/usr/bin/setpriv", f"--reuid={spec['uid']}", f"--regid={spec['gid']}"]
    groups = spec["groups"]
    argv += [f"--groups={','.join(map(str, groups))}"] if groups else ["--clear-groups"]
    argv += [f"--inh-caps={caps}", f"--bounding-set={caps}"]
    if spec["uid"] != 0 and spec["capabilities"]:
        argv += [f"--ambient-caps={caps}"]
    if spec["no_new_privs"]:
        argv += ["--no-new-privs"]
    return [*argv, "--", *spec["argv"]]


def container_main(spec: dict) -> None:
    """PID 1 of the container: never returns."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    try:
        build_root(spec)
        socket.sethostname(spec["hostname"])
        os.chdir(spec["working_dir"])
    except (OSError, SetupError) as exc:
        print(f"keepwarm pod runner: container setup failed: {exc}", file=sys.stderr, flush=True)
        os._exit(128)
    for sig in FORWARDED:
        signal.signal(sig, signal.SIG_DFL)
    try:
        os.execve(setpriv_argv(spec)[0], setpriv_argv(spec), spec["env"])
    except OSError as exc:
        print(f"keepwarm pod runner: exec setpriv: {exc}", file=sys.stderr, flush=True)
        os._exit(128)


def shim(child: int) -> int:
    """Forward signals to the container's PID 1 and return its exit status as a runtime reports it."""
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, _frame: os.kill(child, signum))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except ChildProcessError:
            return 128
        except InterruptedError:
            continue
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def main(path: str) -> int:
    with open(path) as f:
        spec = json.load(f)
    try:
        join_cgroups(spec["cgroup_procs"])
        enter_namespaces(spec["netns"])
    except (OSError, SetupError) as exc:
        print(f"keepwarm pod runner: container setup failed: {exc}", file=sys.stderr, flush=True)
        return 128
    # Block the forwarded signals across the fork so none lands before the shim's handlers exist.
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    child = os.fork()
    if child == 0:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
        container_main(spec)
    return shim(child)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
