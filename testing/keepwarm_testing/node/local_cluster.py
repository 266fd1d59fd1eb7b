"""`make cluster` / `make cluster-down`: the tests' cluster for a person's hands (root only).

`up` starts, in the background, a control plane with one real node (controlplane/cluster.py,
ControlPlane(run_pods=True)) whose mirror serves the Dockerfile's images under the names the chart and
the examples use, writes its admin kubeconfig to STATE/kubeconfig, prints how to use it and returns;
the cluster runs until `down`, which stops it and says what (if anything) it left on the machine. The
node has no GPU: its mirror serves the CPU runtime under the CUDA runtime's name too, so the examples'
default images run, on CPU. Models go under /var/lib/models, as on a node:
`keepwarm make-model /var/lib/models/llama --params 10M`.

    python -m keepwarm_testing.node.local_cluster up|down
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from keepwarm_api.inferencedeployment import DEFAULT_IMAGE

STATE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "keepwarm" / "cluster"
PID, KUBECONFIG, LOG, READY, REPORT = (STATE / n for n in ("pid", "kubeconfig", "log", "ready", "report"))


def serve() -> None:
    """The background process: the cluster, until SIGTERM."""
    from ..controlplane.build import build_control_plane
    from ..controlplane.cluster import ControlPlane

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    cp = ControlPlane(build_control_plane(), run_pods=True)
    nodes = None
    try:
        cp.start()
        nodes = cp.nodes
        assert nodes is not None and nodes.images is not None
        nodes.publish(nodes.images.runtime, DEFAULT_IMAGE)  # the examples' default image, on CPU here
        cp.add_gpu_nodes(1, prefix="node")
        KUBECONFIG.write_text(cp.kubeconfig.read_text())
        KUBECONFIG.chmod(0o600)
        READY.write_text(cp.server + "\n")
        stop.wait()
    finally:
        cp.stop()
        left = nodes.leftovers() if nodes is not None else []
        REPORT.write_text("".join(f"{item}\n" for item in left))


def up(timeout_s: float = 3600.0) -> int:
    if running():
        print(f"a cluster is already up: export KUBECONFIG={KUBECONFIG}")
        return 0
    STATE.mkdir(parents=True, exist_ok=True)
    for path in (READY, REPORT, KUBECONFIG):
        path.unlink(missing_ok=True)
    with open(LOG, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "keepwarm_testing.node.local_cluster", "serve"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    PID.write_text(f"{proc.pid}\n")
    print(f"starting (images are built on the first run: minutes); log {LOG}", flush=True)
    deadline = time.monotonic() + timeout_s
    while not READY.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            print(
                f"the cluster did not come up; log {LOG}:\n" + "\n".join(LOG.read_text().splitlines()[-30:])
            )
            down()
            return 1
        time.sleep(1)
    print(f"up: API server {READY.read_text().strip()}\n\n    export KUBECONFIG={KUBECONFIG}\n"
          "    helm install keepwarm charts/keepwarm -n keepwarm-system --create-namespace\n"
          "    keepwarm make-model /var/lib/models/llama --params 10M   # a model on the node\n"
          "    kubectl apply -f examples/...\n\nmake cluster-down stops it.")  # fmt: skip
    return 0


def running() -> int | None:
    try:
        pid = int(PID.read_text())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid


def down(timeout_s: float = 300.0) -> int:
    pid = running()
    if pid is None:
        print("no cluster is up")
        return 0
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while running() and time.monotonic() < deadline:
        time.sleep(0.5)
    if running():
        print(f"the cluster (pid {pid}) did not stop in {timeout_s:.0f} s; log {LOG}")
        return 1
    left = REPORT.read_text().splitlines() if REPORT.exists() else ["(no report: see the log)"]
    PID.unlink(missing_ok=True)
    print("down: nothing left behind" if not left else "down, but left behind:\n  " + "\n  ".join(left))
    return 0 if not left else 1


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    if command == "serve":
        serve()
    elif command in ("up", "down"):
        sys.exit(up() if command == "up" else down())
    else:
        sys.exit("usage: python -m keepwarm_testing.node.local_cluster up|down")
