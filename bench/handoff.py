"""Hand-off benchmark: how long the node's cache is cold when its daemon is upgraded or killed.

For 1 and 4 models (2 GiB in all, Llama checkpoints from ``keepwarm_runtime.modelgen``, served in
bfloat16 on the host tier), with a descriptor holder (``keepwarm cache hold``) beside the daemons:

* ``handoff_s``: a successor ``keepwarm cache serve`` is started beside the running daemon, under a
  steady stream of attaches from another thread; the time from its spawn until it answers for every
  model (interpreter start and imports included). ``adopt_s`` is the successor's own time to verify
  and take the arenas (from its log). ``fallbacks_during_upgrade`` counts attaches that fell back to
  disk from the successor's spawn until the predecessor exited (goal: 0), of ``attaches_during_upgrade``;
  ``longest_attach_during_upgrade_s`` is the longest of them (a client's longest wait: the switch
  itself, since the listener passes from one daemon to the other and no connection is refused).
* ``crash_recovery_s``: the serving daemon is SIGKILLed and a new one started at once; the time from
  the kill until it answers for every model (it recovers the arenas from the holder).
* ``reload_s``: the way without a holder, for comparison: no holder, no predecessor; a new daemon's
  spawn until it answers for every model, loaded from the checkpoint.
* ``successor_imported_torch``, ``crash_restart_imported_torch``, ``reload_imported_torch``: whether
  that daemon had imported torch once it served every model (torch's library in its memory map). A
  daemon needs torch only to read a checkpoint, so the first two are false and the last true: most
  of a restart's time used to be a new interpreter importing torch (issue 34).
* ``disk_bytes_read``: ``read_bytes`` of ``/proc/<pid>/io`` of the successor (the crash-restarted
  daemon: ``crash_disk_bytes_read``; the reloading one: ``reload_disk_bytes_read``) once it serves
  every model: bytes fetched from the storage layer. With the checkpoint in the page cache, a reload
  also reads 0 there, so ``*_rchar`` (bytes through read(2), page cache included) is reported too:
  the reload's holds the 2 GiB, a successor's only headers and the interpreter's own files.

Run once, alone: ``flock /tmp/kw-bench.lock python -m bench.handoff --json``. The JSON names the
load average before and after and the CPU's vector features, since the figures depend on both.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

from keepwarm_runtime.cache.launcher import DaemonProcess, HolderProcess
from keepwarm_runtime.engine.auto_dtype import BF16_CPU_FLAGS, CPUINFO, parse_cpu_flags

TOTAL_GIB = 2.0
DTYPE = "bfloat16"
ADOPT_LINE = re.compile(r"took (\d+) arenas from the (?:predecessor|holder)[^\n]* in ([0-9.]+)s")


def checkpoints(root: Path, count: int, total_gib: float = TOTAL_GIB) -> list[Path]:
    """``count`` Llama checkpoints of ``total_gib`` / count each, generated once under ``root``."""
    from keepwarm_runtime.modelgen import make_model

    size = total_gib / count
    out = []
    for i in range(count):
        path = root / f"llama-{size:g}gib-{i}"
        if not (path / "model.safetensors.index.json").exists():
            tmp = path.with_name(path.name + ".tmp")
            make_model(tmp, arch="llama", params=int(size * 2**30 / 2), dtype=DTYPE, seed=i, num_shards=1)
            tmp.rename(path)
        out.append(path)
    return out


def proc_io(pid: int) -> dict[str, int]:
    fields = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return {k: int(v) for k, v in fields.items()}


def serves_all(socket_dir: Path, pid: int, count: int) -> bool:
    """The daemon ``pid`` answers on the socket and holds ``count`` models."""
    from keepwarm_runtime.cache.client import CacheAttachError, connect, request

    try:
        with connect(socket_dir / "host.sock", 2.0) as sock:
            stats = request(sock, {"cmd": "stats"})[0]
    except (CacheAttachError, OSError):
        return False
    return stats.get("pid") == pid and len(stats.get("models", {})) == count


def wait_serving(socket_dir: Path, daemon: DaemonProcess, count: int, since: float) -> float:
    """Seconds from ``since`` until ``daemon`` serves every model; its io counters are then kept."""
    daemon.wait_ready(600)
    while not serves_all(socket_dir, daemon.proc.pid, count):
        if daemon.proc.poll() is not None:
            raise RuntimeError(f"daemon exited:\n{daemon.stderr}")
        time.sleep(0.005)
    seconds = time.perf_counter() - since
    daemon.io = proc_io(daemon.proc.pid)  # type: ignore[attr-defined]
    daemon.torch = daemon.imported_torch()  # type: ignore[attr-defined]
    return seconds


def adopt_seconds(daemon: DaemonProcess) -> float | None:
    found = ADOPT_LINE.search(daemon.stderr)
    return float(found.group(2)) if found else None


class AttachStream:
    """Attaches round-robin from a thread (the bytes are mapped, never copied); counts by source."""

    def __init__(self, socket_dir: Path, models: list[Path]) -> None:
        self.socket_dir, self.models = socket_dir, models
        self.events: list[tuple[float, float, str]] = []  # (started, ended, "cache" | "disk")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import torch

        from keepwarm_runtime.cache.client import attach

        i = 0
        while not self._stop.is_set():
            started = time.perf_counter()
            res = attach(
                self.models[i % len(self.models)], self.socket_dir, dtype=torch.bfloat16, timeout_s=30
            )
            self.events.append((started, time.perf_counter(), res.source))
            del res
            i += 1

    def between(self, start: float, end: float) -> list[tuple[float, float, str]]:
        return [e for e in self.events if start <= e[1] and e[0] <= end]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)


def run(models: list[Path], root: Path, total_gib: float) -> dict:
    count = len(models)
    socket_dir = Path(tempfile.mkdtemp(prefix="kw-handoff-", dir=root))
    hold = HolderProcess(socket_dir).wait_ready()
    first = DaemonProcess(socket_dir, models, "--dtype", DTYPE)
    initial_load_s = wait_serving(socket_dir, first, count, first.started)
    stream = AttachStream(socket_dir, models)
    while len(stream.events) < 3:
        time.sleep(0.05)
    spawn = time.perf_counter()
    second = DaemonProcess(socket_dir, models, "--dtype", DTYPE)
    handoff_s = wait_serving(socket_dir, second, count, spawn)
    first.wait_exit(120)
    during = stream.between(spawn, time.perf_counter())
    time.sleep(0.5)
    stream.stop()

    killed = time.perf_counter()
    os.kill(second.proc.pid, signal.SIGKILL)
    second.proc.wait()
    third = DaemonProcess(socket_dir, models, "--dtype", DTYPE)
    crash_recovery_s = wait_serving(socket_dir, third, count, killed)
    third.terminate()
    hold.terminate()

    fourth = DaemonProcess(socket_dir, models, "--dtype", DTYPE)
    reload_s = wait_serving(socket_dir, fourth, count, fourth.started)
    fourth.terminate()
    shutil.rmtree(socket_dir, ignore_errors=True)
    return {
        "models": count,
        "total_gib": total_gib,
        "initial_load_s": round(initial_load_s, 3),
        "handoff_s": round(handoff_s, 3),
        "adopt_s": adopt_seconds(second),
        "crash_recovery_s": round(crash_recovery_s, 3),
        "crash_adopt_s": adopt_seconds(third),
        "reload_s": round(reload_s, 3),
        "disk_bytes_read": second.io["read_bytes"],  # type: ignore[attr-defined]
        "rchar": second.io["rchar"],  # type: ignore[attr-defined]
        "crash_disk_bytes_read": third.io["read_bytes"],  # type: ignore[attr-defined]
        "crash_rchar": third.io["rchar"],  # type: ignore[attr-defined]
        "reload_disk_bytes_read": fourth.io["read_bytes"],  # type: ignore[attr-defined]
        "reload_rchar": fourth.io["rchar"],  # type: ignore[attr-defined]
        "fallbacks_during_upgrade": sum(source == "disk" for _, _, source in during),
        "longest_attach_during_upgrade_s": round(max(end - start for start, end, _ in during), 3),
        "attaches_during_upgrade": len(during),
        "successor_loaded_from_disk": "loaded " in second.stderr,
        "crash_restart_loaded_from_disk": "loaded " in third.stderr,
        "successor_imported_torch": second.torch,  # type: ignore[attr-defined]
        "crash_restart_imported_torch": third.torch,  # type: ignore[attr-defined]
        "reload_imported_torch": fourth.torch,  # type: ignore[attr-defined]
    }


def cpu_features() -> list[str]:
    """The vector features the figures depend on (an interpreter importing torch, a checkpoint read)."""
    try:
        flags = parse_cpu_flags(CPUINFO.read_text())
    except OSError:
        return []
    return sorted(flags & {"avx2", "avx512f", *BF16_CPU_FLAGS})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.handoff", description=__doc__.split("\n")[0])
    parser.add_argument("--models", type=int, nargs="+", default=[1, 4], help="model counts to run")
    parser.add_argument("--root", default=str(Path.home() / ".cache" / "keepwarm" / "bench-handoff"))
    parser.add_argument("--total-gib", type=float, default=TOTAL_GIB, help="weights in all, per run")
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    args = parser.parse_args(argv)
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    loadavg_before = os.getloadavg()
    runs = [run(checkpoints(root, n, args.total_gib), root, args.total_gib) for n in args.models]
    result = {
        "benchmark": "handoff",
        "tier": "host",
        "dtype": DTYPE,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "cpu_features": cpu_features()},
        "loadavg_before": loadavg_before,
        "loadavg_after": os.getloadavg(),
        "runs": runs,
    }
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
