"""Operator scale run on the real test control plane: N InferenceDeployments over M fake GPU nodes.

    .venv/bin/python bench/operator_scale.py [--crs 200] [--nodes 100] [--json-out FILE]

Starts etcd + kube-apiserver + controller-manager + scheduler + fake kubelet (keepwarm_testing),
installs the CRDs and the chart's RBAC, runs `keepwarm-operator run` in a subprocess as the chart's
ServiceAccount (the end-to-end tests' harness), makes one WeightCache over all nodes, creates the
InferenceDeployments from --create-threads clients at once (optionally paced to --create-rate per
second, open loop), and prints JSON:
  deployment_latency_s   CR created -> a Deployment owned by it exists (p50/p99/max/mean)
  status_latency_s       CR created -> status.observedGeneration == metadata.generation
  available_latency_s    CR created -> condition Available=True (scheduling + fake kubelet included)
  create_rate_per_s      InferenceDeployments the clients created per second; create_call_s the
                         round trip of one create (p50/p99)
  operator_rss_mib       operator resident memory at the end; operator_peak_rss_mib its VmHWM;
                         operator_rss_mib_idle before the first CR
  operator_cpu_s_converging  CPU seconds the operator used from the first create to convergence;
                         cpu_s_converging the same for each process of the run (API server, etcd,
                         controllers, scheduler, the agents' process, this one with the fake kubelet)
  operator_steady_state  the operator's API requests/s once converged, reads and writes apart, by
                         verb and resource (audit log; goal: zero writes when nothing changes)
  agent_steady_state     the same for the node agents, per agent: --agents of them run the real
                         NodeAgent code in one child process (a fake daemon that holds whatever it
                         is asked to), each with the agent ServiceAccount's token bound to its pod;
                         on a real cluster each runs on its own node, so they get their own process
                         here, not the threads of the process that creates and measures
Latencies run from the client's send time (a timestamp taken just before each create request is
sent) to the watch event that shows the result, so they include the create's own round trip and
watch delivery; `*_from_seen` run instead from the watch event that first shows the created
InferenceDeployment (the same clock as the result, no client queueing). A benchmark, not a test:
nothing here asserts speed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from keepwarm_api.kube import AGENT_FIELD_MANAGER, connect
from keepwarm_runtime.agent.kubernetes import NodeAgent
from keepwarm_runtime.bench_cli import publish
from keepwarm_runtime.cache.snapshot import DaemonSnapshot, ModelSnapshot
from keepwarm_testing.controlplane.build import build_control_plane
from keepwarm_testing.controlplane.cluster import ControlPlane
from keepwarm_testing.operator import (
    GROUP_PATH,
    OPERATOR_SA,
    OperatorProcess,
    condition,
    install_chart_rbac,
    install_crds,
)
from keepwarm_testing.operator import NAMESPACE as OPERATOR_NAMESPACE
from keepwarm_testing.snapshots import daemon_snapshot, resident

NAMESPACE = "scale"


def percentiles(values: list[float]) -> dict[str, float | int]:
    if not values:
        return {"n": 0}
    ordered = sorted(values)

    def pct(p: float) -> float:
        return round(ordered[min(len(ordered) - 1, round(p * (len(ordered) - 1)))], 3)

    return {"n": len(ordered), "p50": pct(0.5), "p99": pct(0.99), "max": round(ordered[-1], 3),
            "mean": round(statistics.fmean(ordered), 3)}  # fmt: skip


class Watcher(threading.Thread):
    """Records the first time each named object in NAMESPACE satisfies `done(obj)`."""

    def __init__(self, cp: ControlPlane, path: str, done, key=lambda obj: obj["metadata"]["name"]) -> None:
        super().__init__(daemon=True)
        self.client = cp.http_client(httpx.Timeout(30.0, read=None))
        self.path, self.done, self.key = path, done, key
        self.seen: dict[str, float] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                listing = self.client.get(self.path).json()
                for obj in listing["items"]:
                    self._check(obj)
                params = {"watch": "1", "resourceVersion": listing["metadata"]["resourceVersion"],
                          "timeoutSeconds": "30"}  # fmt: skip
                with self.client.stream("GET", self.path, params=params) as resp:
                    for line in resp.iter_lines():
                        if self.stop.is_set():
                            return
                        if line:
                            event = json.loads(line)
                            if event["type"] in ("ADDED", "MODIFIED"):
                                self._check(event["object"])
            except (httpx.HTTPError, KeyError, json.JSONDecodeError):
                time.sleep(0.5)

    def _check(self, obj: dict) -> None:
        key = self.key(obj)
        if key and key not in self.seen and self.done(obj):
            self.seen[key] = time.monotonic()


def inference_deployment(name: str) -> dict:
    return {
        "apiVersion": "keepwarm.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"model": {"cacheRef": "scale", "name": "m"}, "replicas": 1, "gpusPerPod": 1},
    }


WEIGHT_CACHE = {
    "apiVersion": "keepwarm.dev/v1alpha1",
    "kind": "WeightCache",
    "metadata": {"name": "scale"},
    "spec": {
        "tier": "host",
        "nodeSelector": {"pool": "scale"},
        "models": [{"name": "m", "source": {"path": "/var/lib/models/m"}}],  # under modelDirectory
    },
}


def owner_name(obj: dict) -> str | None:
    for ref in obj["metadata"].get("ownerReferences", []):
        if ref.get("kind") == "InferenceDeployment":
            return ref["name"]
    return None


def observed(obj: dict) -> bool:
    return (obj.get("status") or {}).get("observedGeneration") == obj["metadata"].get("generation")


def available(obj: dict) -> bool:
    return condition(obj, "Available").get("status") == "True"


def memory_mib(pid: int) -> dict[str, float]:
    """VmRSS (now) and VmHWM (peak) of a process, in MiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = round(int(value.split()[0]) / 1024, 1)
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def counters(op: OperatorProcess) -> dict[str, float]:
    """The operator's nonzero keepwarm_operator_*_total counters (reconciles, errors, applies) and
    the mean wall time of a reconcile by kind (histogram _sum / _count)."""
    out, sums = {}, {}
    for s in op.samples():
        labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
        if s.name.startswith("keepwarm_operator_") and s.name.endswith("_total") and s.value:
            out[f"{s.name.removeprefix('keepwarm_operator_')}{{{labels}}}"] = s.value
        elif s.name.startswith("keepwarm_operator_reconcile_duration_seconds_"):
            sums.setdefault(labels, {})[s.name.rsplit("_", 1)[1]] = s.value
    for labels, v in sums.items():
        if v.get("count"):
            out[f"reconcile_duration_mean_s{{{labels}}}"] = round(v["sum"] / v["count"], 3)
    return out


WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection"}
OPERATOR_USER = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{OPERATOR_SA}"
AGENT_USER = f"system:serviceaccount:{OPERATOR_NAMESPACE}:keepwarm-agent-scale"


def rates(events: list[dict], window_s: float, per: int = 1) -> dict:
    """Requests/s over the window (divided by `per`: agents), reads and writes apart; counts by
    verb and resource. A watch counts when it ends (the audit log's ResponseComplete)."""
    by_call: dict[str, int] = {}
    for e in events:
        ref = e.get("objectRef") or {}
        call = f"{e['verb']} {ref.get('resource', e.get('requestURI', '?'))}"
        call += f"/{ref['subresource']}" if ref.get("subresource") else ""
        by_call[call] = by_call.get(call, 0) + 1
    writes = sum(1 for e in events if e["verb"] in WRITE_VERBS)
    return {
        "window_s": window_s,
        "requests_per_s": round(len(events) / window_s / per, 4),
        "reads_per_s": round((len(events) - writes) / window_s / per, 4),
        "writes_per_s": round(writes / window_s / per, 4),
        "requests_by_call": dict(sorted(by_call.items())),
    }


def steady_state_rates(cp: ControlPlane, window_s: float, agents: int) -> dict[str, dict]:
    """The operator's and the agents' API requests per second over `window_s` once everything
    converged, from the API server's audit log (goal: zero writes when nothing changes)."""
    start = time.time()
    time.sleep(window_s + 1.5)  # the audit log batches for up to 1 s
    out = {"operator": rates(cp.audit_events(OPERATOR_USER, since=start), window_s)}
    if agents:
        out["agent"] = rates(cp.audit_events(AGENT_USER, since=start), window_s, per=agents)
    return out


class FakeDaemon:
    """Stands in for the cache daemon under a bench agent: holds whatever it is asked to, at once."""

    def __init__(self) -> None:
        self.models: dict[str, ModelSnapshot] = {}

    def add_model(self, path: str, pin: bool = False, quantization: str | None = None) -> str:
        name = Path(path).name
        self.models[name] = resident(name, 1 << 30, pinned=pin)
        return name

    def remove_model(self, name: str) -> None:
        self.models.pop(name, None)

    def snapshot(self) -> DaemonSnapshot:
        return daemon_snapshot(self.models)


def agent_specs(cp: ControlPlane, n: int) -> list[tuple[str, str]]:
    """(node, kubeconfig) for the first n agent pods, each kubeconfig holding its pod's bound token."""
    pods_path = f"/api/v1/namespaces/{OPERATOR_NAMESPACE}/pods?labelSelector=keepwarm.dev/weightcache=scale"
    deadline = time.monotonic() + 300
    while True:
        pods = [p for p in cp.http.get(pods_path).json()["items"] if p["spec"].get("nodeName")]
        if len(pods) >= n or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    pods = sorted(pods, key=lambda p: p["spec"]["nodeName"])[:n]
    sa = "keepwarm-agent-scale"
    return [
        (
            p["spec"]["nodeName"],
            str(cp.service_account_kubeconfig(OPERATOR_NAMESPACE, sa, create=False, bound_pod=p)),
        )
        for p in pods
    ]


def start_agents(specs: list[tuple[str, str]], log: Path) -> subprocess.Popen:
    """The agents in a child process (run_agents), which stops when its stdin closes."""
    proc = subprocess.Popen(
        [sys.executable, __file__, "--run-agents", json.dumps(specs)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(log, "a"), text=True,  # noqa: SIM115 (lives as long as it)
    )  # fmt: skip
    if proc.stdout is None or proc.stdout.readline().strip() != "started":
        raise RuntimeError(f"bench agents did not start (see {log})")
    return proc


def run_agents(specs: list[tuple[str, str]]) -> None:
    """Child process: the real NodeAgent code for each (node, kubeconfig) until stdin closes."""
    stop = threading.Event()
    for node, kubeconfig in specs:
        kube = connect(kubeconfig, AGENT_FIELD_MANAGER)
        agent = NodeAgent(FakeDaemon(), "scale", node, kube, namespace=OPERATOR_NAMESPACE)
        threading.Thread(target=agent.run, args=(stop,), daemon=True, name="bench-agent").start()
    print("started", flush=True)
    sys.stdin.read()
    stop.set()


def create_all(
    cp: ControlPlane, names: list[str], threads: int, rate: float
) -> dict[str, tuple[float, float]]:
    """Create the InferenceDeployments from `threads` clients; with rate > 0 the n-th send is due
    n/rate seconds after the first (open loop). Returns name -> (send time, response time)."""
    local = threading.local()
    t0 = time.monotonic()

    def create(i: int) -> tuple[str, float, float]:
        if rate > 0:
            time.sleep(max(0.0, t0 + i / rate - time.monotonic()))
        http = getattr(local, "http", None) or cp.http_client()
        local.http = http
        name = names[i]
        sent = time.monotonic()
        resp = http.post(
            f"{GROUP_PATH}/namespaces/{NAMESPACE}/inferencedeployments", json=inference_deployment(name)
        )
        if resp.status_code != 201:
            raise RuntimeError(f"create {name}: HTTP {resp.status_code}: {resp.text}")
        return name, sent, time.monotonic()

    with ThreadPoolExecutor(threads) as pool:
        return {name: (sent, done) for name, sent, done in pool.map(create, range(len(names)))}


def run(cp: ControlPlane, args: argparse.Namespace, result: dict) -> None:
    t0 = time.monotonic()
    cp.add_gpu_nodes(args.nodes, labels={"pool": "scale"}, prefix="scale")
    result["nodes_register_s"] = round(time.monotonic() - t0, 1)
    install_crds(cp)
    install_chart_rbac(cp)  # the operator runs as the chart's ServiceAccount, with the chart's RBAC
    op = OperatorProcess(cp, cp.logs, resync_s=args.resync_seconds).start()
    agent_proc: subprocess.Popen | None = None
    try:
        result["operator_rss_mib_idle"] = memory_mib(op.proc.pid)["VmRSS"]
        cp.kubectl("apply", "-f", "-", input=json.dumps(WEIGHT_CACHE))
        cp.kubectl("create", "namespace", NAMESPACE)
        t0 = time.monotonic()
        specs = agent_specs(cp, min(args.agents, args.nodes))
        agent_proc = start_agents(specs, cp.logs / "bench-agents.log") if specs else None
        result["agents"] = len(specs)
        ready_path = f"{GROUP_PATH}/weightcaches/scale"
        while time.monotonic() - t0 < args.timeout_s:  # every agent reported the model resident
            if condition(cp.http.get(ready_path).json(), "Ready").get("status") == "True" or not specs:
                break
            time.sleep(1.0)
        result["agents_ready_s"] = round(time.monotonic() - t0, 1)
        watchers = {
            "deployment": Watcher(
                cp, f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments", lambda d: True, owner_name
            ),
            "status": Watcher(cp, f"{GROUP_PATH}/namespaces/{NAMESPACE}/inferencedeployments", observed),
            "available": Watcher(cp, f"{GROUP_PATH}/namespaces/{NAMESPACE}/inferencedeployments", available),
        }
        seen = Watcher(cp, f"{GROUP_PATH}/namespaces/{NAMESPACE}/inferencedeployments", lambda _: True)
        seen.start()
        for w in watchers.values():
            w.start()
        time.sleep(1.0)  # let the watches open before the first create

        pids = {"operator": op.proc.pid, "bench": os.getpid()} | {n: p.pid for n, p in cp.procs.items()}
        if agent_proc is not None:
            pids["agents"] = agent_proc.pid
        cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        t_create, cpu_create = time.monotonic(), cpu_before["operator"]
        calls = create_all(
            cp, [f"idep-{i:04d}" for i in range(args.crs)], args.create_threads, args.create_rate
        )
        result["create_all_s"] = round(time.monotonic() - t_create, 2)
        result["create_rate_per_s"] = round(args.crs / max(result["create_all_s"], 1e-6), 1)
        result["create_call_s"] = percentiles([done - sent for sent, done in calls.values()])
        created = {name: sent for name, (sent, _) in calls.items()}

        deadline = time.monotonic() + args.timeout_s
        while time.monotonic() < deadline and op.proc.poll() is None:
            if all(len(w.seen) >= args.crs for w in watchers.values()):
                break
            time.sleep(0.5)
        result["all_converged_s"] = round(time.monotonic() - t_create, 1)
        if op.proc.poll() is None:  # share of one core the operator used while converging
            result["operator_cpu_s_converging"] = round(cpu_seconds(op.proc.pid) - cpu_create, 1)
            # ... and every process of the run (the control plane shares the box's cores with it)
            result["cpu_s_converging"] = {
                name: round(cpu_seconds(pid) - cpu_before[name], 1) for name, pid in pids.items()
            }
        for label, w in watchers.items():
            result[f"{label}_latency_s"] = percentiles(
                [w.seen[n] - created[n] for n in created if n in w.seen]
            )
            result[f"{label}_latency_s_from_seen"] = percentiles(
                [w.seen[n] - seen.seen[n] for n in created if n in w.seen and n in seen.seen]
            )
            w.stop.set()
        seen.stop.set()
        # Per CR, Unix times (to set beside the audit log's): sent, seen, deployment, status, available.
        wall = time.time() - time.monotonic()
        timeline = {
            n: {"sent": round(created[n] + wall, 3)}
            | {k: round(w.seen[n] + wall, 3) for k, w in {"seen": seen, **watchers}.items() if n in w.seen}
            for n in created
        }
        (cp.logs / "bench-timeline.json").write_text(json.dumps(timeline, indent=0))
        result["operator_alive"] = op.proc.poll() is None
        if result["operator_alive"]:
            mem = memory_mib(op.proc.pid)
            result["operator_rss_mib"] = mem["VmRSS"]
            result["operator_peak_rss_mib"] = mem["VmHWM"]
        result["operator_log_errors"] = len(op.errors())
        if result["operator_alive"]:
            result["operator_metrics"] = counters(op)
            time.sleep(args.settle_s)  # rollouts' last status updates land after Available
            steady = steady_state_rates(cp, args.steady_window_s, result["agents"])
            result["operator_steady_state"] = steady["operator"]
            if "agent" in steady:
                result["agent_steady_state"] = steady["agent"]
        result["fake_kubelet"] = {
            "pods_started": cp.kubelet.stats.pods_started,
            "errors": cp.kubelet.stats.errors,
        }
    finally:
        if agent_proc is not None:
            agent_proc.communicate(timeout=60)  # closes its stdin: the agents stop
        op.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--crs", type=int, default=200, help="InferenceDeployments to create")
    ap.add_argument("--nodes", type=int, default=100, help="fake GPU nodes (8 GPUs each)")
    ap.add_argument("--agents", type=int, default=1 << 30, help="node agents to run (default: one per node)")
    ap.add_argument("--create-threads", type=int, default=16, help="clients creating at once")
    ap.add_argument(
        "--create-rate", type=float, default=0.0, help="creates/s, open loop (0: as fast as possible)"
    )
    ap.add_argument("--run-agents", default=None, help=argparse.SUPPRESS)  # the agents' child process
    ap.add_argument("--resync-seconds", type=float, default=30.0, help="operator resync period")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="give up waiting after this long")
    ap.add_argument("--settle-s", type=float, default=30.0, help="wait after convergence, then sample")
    ap.add_argument("--steady-window-s", type=float, default=60.0, help="steady-state request sampling")
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--keep-logs", type=Path, default=None, help="copy the component and operator logs here")
    args = ap.parse_args(argv)
    if args.run_agents is not None:
        run_agents([tuple(spec) for spec in json.loads(args.run_agents)])
        return 0

    t0 = time.monotonic()
    bin_dir = build_control_plane()
    result: dict = {"crs": args.crs, "nodes": args.nodes, "build_or_cache_s": round(time.monotonic() - t0, 1)}
    t0 = time.monotonic()
    with ControlPlane(bin_dir) as cp:
        result["control_plane_start_s"] = round(time.monotonic() - t0, 1)
        try:
            run(cp, args, result)
        finally:
            if args.keep_logs:
                shutil.copytree(cp.logs, args.keep_logs, dirs_exist_ok=True)
    result["machine"] = f"{os.cpu_count()}-core CPU, shared with other work"
    result["load_average"] = [round(x, 2) for x in os.getloadavg()]
    publish(result, args.json_out)
    return 0 if result.get("deployment_latency_s", {}).get("n") == args.crs else 1


if __name__ == "__main__":
    sys.exit(main())
