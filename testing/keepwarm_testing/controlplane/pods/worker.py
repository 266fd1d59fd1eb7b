"""One pod's life on its node, in one thread: sandbox, init containers, containers, probes, deletion.

  1. sandbox: a cgroup with the pod's limits, a network namespace with an IP from the node's podCIDR,
     the volumes on disk; failures are reported (reason and message in the container's waiting state)
     and retried every few seconds, as a kubelet does;
     configMap and secret volumes then follow their objects while the pod runs (volumes.refresh);
  2. init containers one after the other, each to exit 0 (restarted with backoff otherwise);
  3. the containers: started together; startup, readiness and liveness probes set `started` and
     `ready` (readiness is probed at once when the startup probe passes, as the kubelet does); an
     exit, or a failed startup or liveness probe (SIGTERM, SIGKILL after the grace period), restarts
     the container under restartPolicy Always with the kubelet's backoff: the first restart at once,
     then 10 s doubling to 5 min (CrashLoopBackOff while waiting), reset after a run of 10 min;
     restartCount and lastState as the kubelet reports them;
  4. deletion: each running container's preStop hook (lifecycle.py), all at once, within the pod's
     grace period; then SIGTERM to every container, SIGKILL to the whole cgroup once the rest of the
     period is spent (at least 2 s after a hook that overran, as the kubelet grants), then the
     namespace, veth, cgroup and pod directory go, and the Pod object is deleted for good.
Every change of what a user sees is PATCHed to the pod's status.
"""

from __future__ import annotations

import logging
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import container as ct
from . import lifecycle, probes, volumes
from .env import ConfigError, container_argv, container_env
from .status import ContainerView, pod_status, terminated, timestamp, without_times

if TYPE_CHECKING:
    from .runner import PodRunner, RunnerNode

log = logging.getLogger("keepwarm.test.pods")
TICK_S = 0.1
SANDBOX_RETRY_S = 2.0
CONFIG_SYNC_S = 1.0  # how often configMap and secret volumes follow their objects (a kubelet: ~1 min)


@dataclass
class Backoff:
    initial_s: float = 10.0
    max_s: float = 300.0
    current_s: float = 0.0  # delay before the next restart (0: restart at once)

    def next_delay(self, ran_s: float) -> float:
        if ran_s > 2 * self.max_s:
            self.current_s = 0.0
        delay = self.current_s
        self.current_s = self.initial_s if not delay else min(2 * delay, self.max_s)
        return delay


@dataclass
class ContainerRun:
    spec: dict[str, Any]
    view: ContainerView
    init: bool = False
    running: ct.Running | None = None
    launch: ct.Launch | None = None
    started_mono: float = 0.0
    started_wall: str = ""
    restart_at: float = 0.0  # monotonic time of the next start (when not running)
    kill_deadline: float | None = None  # SIGKILL at this time (a liveness or startup kill under way)
    kill_reason: str = ""
    succeeded: bool = False  # an init container that exited 0
    backoff: Backoff = field(default_factory=Backoff)
    probes: dict[str, probes.ProbeState] = field(default_factory=dict)


class PodWorker:
    def __init__(self, runner: PodRunner, node: RunnerNode, pod: dict[str, Any]) -> None:
        self.runner = runner
        self.node = node
        self.pod = pod
        meta = pod["metadata"]
        self.uid, self.namespace, self.name = meta["uid"], meta["namespace"], meta["name"]
        self.dir = runner.root / "pods" / self.uid
        self.host_network = bool(pod["spec"].get("hostNetwork"))
        self.pod_ip: str | None = None
        self.netns: str | None = None
        self.cgroup = runner.cgroup_for(self.uid)
        self.volumes: dict[str, Path] = {}
        self.next_config_sync = 0.0  # monotonic time of the next configMap/secret volume refresh
        self.delete_requested = threading.Event()
        self.grace_s = 30.0
        self.message: str | None = None
        self.sandbox_ready = False
        self._last_patched: Any = None
        self.inits = [
            ContainerRun(c, ContainerView(c["name"], c.get("image", "")), init=True)
            for c in pod["spec"].get("initContainers", [])
        ]
        self.containers = [
            ContainerRun(c, ContainerView(c["name"], c.get("image", ""))) for c in pod["spec"]["containers"]
        ]
        self.thread = threading.Thread(target=self._run, name=f"kwt-pod-{self.name}", daemon=True)

    # -- control from the runner -----------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def request_delete(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.delete_requested.set()

    def log_path(self, container: str) -> Path | None:
        """The log of the container's current (or last) process."""
        for run in (*self.inits, *self.containers):
            if run.spec["name"] == container and run.running is not None:
                return run.running.log
        return None

    # -- the loop --------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self.delete_requested.is_set() and not self.runner.stopping.is_set():
                if not self.sandbox_ready:
                    self._try_sandbox()
                else:
                    self._tick()
                self._patch_status()
                self.delete_requested.wait(TICK_S if self.sandbox_ready else SANDBOX_RETRY_S)
        except Exception:
            log.exception("pod %s/%s: runner loop failed", self.namespace, self.name)
        finally:
            self._terminate()
            self._teardown()
            if self.delete_requested.is_set() and not self.runner.stopping.is_set():
                self.runner.finalize(self.pod)

    def _try_sandbox(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.cgroup.create(self.runner.pod_limits(self.pod))
            if self.host_network:
                self.pod_ip = self.node.ip
            elif self.netns is None:
                self.pod_ip = self.runner.network.allocate(self.node.index)
                self.netns = str(self.runner.network.create_pod_netns(self.uid, self.pod_ip, self.name))
            self.pod.setdefault("status", {}).update(
                podIP=self.pod_ip,
                podIPs=[{"ip": self.pod_ip}],
                hostIP=self.node.ip,
                hostIPs=[{"ip": self.node.ip}],
            )
            self.volumes = volumes.prepare(self.pod, self.node.root, self.dir, self.runner.api)
        except (volumes.VolumeError, ConfigError, OSError, RuntimeError) as exc:
            self.message = str(exc)
            for run in self.inits + self.containers:
                run.view.state = {"waiting": {"reason": "ContainerCreating", "message": str(exc)}}
            log.warning("pod %s/%s: sandbox: %s", self.namespace, self.name, exc)
            return
        self.message = None
        self.sandbox_ready = True
        self.grace_s = float(self.pod["spec"].get("terminationGracePeriodSeconds", 30))

    def _tick(self) -> None:
        now = time.monotonic()
        if now >= self.next_config_sync and volumes.refreshable(self.pod):
            self.next_config_sync = now + CONFIG_SYNC_S
            for name in volumes.refresh(self.pod, self.dir, self.runner.api):
                log.info("pod %s/%s: volume %s updated", self.namespace, self.name, name)
        pending_init = next((run for run in self.inits if not run.succeeded), None)
        if pending_init is not None:
            self._drive(pending_init)
            return
        for run in self.containers:
            self._drive(run)

    def _drive(self, run: ContainerRun) -> None:
        now = time.monotonic()
        if run.running is not None:
            code = run.running.exit_code()
            if code is None:
                self._probe(run, now)
                if run.kill_deadline is not None and now >= run.kill_deadline:
                    run.running.signal(signal.SIGKILL)
                return
            self._exited(run, code, now)
            return
        if now >= run.restart_at:
            self._start(run, now)

    def _start(self, run: ContainerRun, now: float) -> None:
        try:
            run.launch = self._launch(run.spec)
        except (ConfigError, ValueError) as exc:
            run.view.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(exc)}}
            run.restart_at = now + SANDBOX_RETRY_S
            return
        workdir = self.dir / "containers" / run.spec["name"] / str(run.view.restart_count)
        shutil.rmtree(workdir, ignore_errors=True)
        run.running = ct.start(run.launch, workdir)
        run.started_mono, run.started_wall = now, timestamp()
        run.kill_deadline, run.kill_reason = None, ""
        run.view.container_id = f"kwt://{self.uid}/{run.spec['name']}/{run.running.shim_pid}"
        run.view.state = {"running": {"startedAt": run.started_wall}}
        run.view.ready = False
        run.probes = {}
        if not run.init:
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                if kind in run.spec:
                    run.probes[kind] = probes.ProbeState(run.spec[kind], now)
        run.view.started = not run.init and "startupProbe" not in run.probes
        if run.view.started and "readinessProbe" not in run.probes:
            run.view.ready = True

    def _exited(self, run: ContainerRun, code: int, now: float) -> None:
        assert run.running is not None
        reason = run.kill_reason or None
        run.view.last_state = terminated(code, run.started_wall, run.view.container_id, reason)
        run.view.ready = False
        run.view.started = False
        run.running = None
        if run.init and code == 0:
            run.succeeded = True
            run.view.state = run.view.last_state
            run.view.last_state = {}
            run.view.ready = True
            return
        policy = self.pod["spec"].get("restartPolicy", "Always")
        if policy == "Never" or (policy == "OnFailure" and code == 0):
            run.view.state = run.view.last_state
            run.restart_at = float("inf")
            return
        delay = run.backoff.next_delay(now - run.started_mono)
        run.view.restart_count += 1
        run.restart_at = now + delay
        if delay:
            message = f"back-off {delay:.0f}s restarting failed container={run.spec['name']} pod={self.name}"
            run.view.state = {"waiting": {"reason": "CrashLoopBackOff", "message": message}}

    def _probe(self, run: ContainerRun, now: float) -> None:
        if run.kill_deadline is not None or run.running is None or run.launch is None:
            return
        ip = "127.0.0.1" if self.host_network else (self.pod_ip or "")
        order = ["livenessProbe", "readinessProbe"] if run.view.started else ["startupProbe"]
        for kind in order:
            state = run.probes.get(kind)
            if state is None or not state.due(now):
                continue
            try:
                ok = probes.attempt(
                    state.probe, run.spec, ip, run.running.pid1(), run.launch.uid, run.launch.gid
                )
            except probes.ProbeConfigError as exc:
                log.warning("pod %s/%s: %s", self.namespace, self.name, exc)
                ok = False
            state.record(ok, time.monotonic())
            if kind == "startupProbe" and state.passed:
                run.view.started = True
                run.view.ready = "readinessProbe" not in run.probes
                if "readinessProbe" in run.probes:  # the kubelet probes readiness at once after startup
                    run.probes["readinessProbe"].next_at = now
            elif kind == "readinessProbe":
                run.view.ready = state.passed
            if kind in ("startupProbe", "livenessProbe") and state.failed:
                self._kill(run, "Error", now)
                return

    def _kill(self, run: ContainerRun, reason: str, now: float) -> None:
        """A failed liveness or startup probe: SIGTERM now, SIGKILL after the grace period."""
        assert run.running is not None
        log.info(
            "pod %s/%s: container %s failed a probe: restarting", self.namespace, self.name, run.spec["name"]
        )
        run.kill_reason = reason
        run.kill_deadline = now + self.grace_s
        run.view.ready = False
        run.running.signal(signal.SIGTERM)

    # -- launch ----------------------------------------------------------------------------------
    def _launch(self, spec: dict[str, Any]) -> ct.Launch:
        lifecycle.check(spec)
        pod_sec = self.pod["spec"].get("securityContext") or {}
        sec = spec.get("securityContext") or {}
        image = self.runner.image(spec.get("image", ""))
        uid = int(sec.get("runAsUser", pod_sec.get("runAsUser", image.uid)))
        gid = int(sec.get("runAsGroup", pod_sec.get("runAsGroup", image.gid if uid == image.uid else 0)))
        groups = [gid, *(int(g) for g in pod_sec.get("supplementalGroups", []))]  # runc lists the gid too
        if "fsGroup" in pod_sec:
            groups.append(int(pod_sec["fsGroup"]))
        if sec.get("runAsNonRoot", pod_sec.get("runAsNonRoot")) and uid == 0:
            raise ConfigError("container has runAsNonRoot and image will run as root")
        if sec.get("privileged"):
            raise ConfigError("privileged containers are not supported by the pod runner")
        base = {
            "PATH": self.runner.image_path,
            "HOME": "/root" if uid == 0 else "/",
            **self.runner.service_env,
        }
        env = container_env(self.pod, spec, self.runner.api.lookup, base)
        mounts = []
        for m in spec.get("volumeMounts", []):
            if m["name"] not in self.volumes:
                raise ConfigError(f"volumeMount {m['name']!r} names no volume of the pod")
            source = self.volumes[m["name"]]
            if m.get("subPath"):
                source = source / m["subPath"]
                if not source.exists():
                    source.mkdir(parents=True)
            mounts.append(ct.Mount(str(source), m["mountPath"], bool(m.get("readOnly"))))
        return ct.Launch(
            argv=container_argv(spec, env, image.entrypoint, image.cmd),
            env=env,
            uid=uid,
            gid=gid,
            groups=sorted(set(groups)),
            capabilities=ct.effective_capabilities(sec),
            hostname=self.pod["spec"].get("hostname") or self.name,
            working_dir=spec.get("workingDir") or image.working_dir,
            mounts=mounts,
            read_only_root=bool(sec.get("readOnlyRootFilesystem")),
            no_new_privs=sec.get("allowPrivilegeEscalation") is False,
            netns=self.netns,
            cgroup_procs=[str(p) for p in self.cgroup.procs_files()],
        )

    # -- status and teardown ---------------------------------------------------------------------
    def _patch_status(self) -> None:
        status = pod_status(
            old=self.pod.get("status", {}),
            sandbox_ready=self.sandbox_ready,
            initialized=all(run.succeeded for run in self.inits),
            inits=[run.view for run in self.inits],
            containers=[run.view for run in self.containers],
            pod_ip=self.pod_ip if self.sandbox_ready else None,
            host_ip=self.node.ip,
            message=self.message,
        )
        key = without_times(status)
        if key == self._last_patched:
            return
        if self.runner.patch_status(self.pod, status):
            self._last_patched = key
            self.pod["status"] = status

    def _terminate(self) -> None:
        """preStop hooks, then SIGTERM every container, wait out the grace period, SIGKILL what is left."""
        grace_s = 0.0 if self.runner.stopping.is_set() else self.grace_s
        hooks_s = self._pre_stop(grace_s)
        live = [run.running for run in (*self.inits, *self.containers) if run.running is not None]
        for running in live:
            running.signal(signal.SIGTERM)
        left_s = grace_s - hooks_s
        if hooks_s:
            left_s = max(left_s, lifecycle.MIN_GRACE_AFTER_HOOK_S)
        deadline = time.monotonic() + left_s
        while time.monotonic() < deadline and any(r.exit_code() is None for r in live):
            time.sleep(0.05)
        self.cgroup.kill_all()
        for running in live:
            running.proc.wait()

    def _pre_stop(self, budget_s: float) -> float:
        """Run the running containers' preStop hooks side by side, for at most budget_s; the seconds
        spent (0 when no container has one)."""
        hooked = [
            run
            for run in self.containers
            if run.running is not None
            and run.launch is not None
            and "preStop" in (run.spec.get("lifecycle") or {})
        ]
        if not hooked or budget_s <= 0:
            return 0.0
        ip = "127.0.0.1" if self.host_network else (self.pod_ip or "")
        started = time.monotonic()
        threads = []
        for run in hooked:
            assert run.running is not None and run.launch is not None
            target = lifecycle.HookTarget(ip, run.running.pid1(), run.launch.uid, run.launch.gid)
            args = (run.spec, target, budget_s, self.runner.stopping)
            threads.append(threading.Thread(target=lifecycle.pre_stop, args=args, daemon=True))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(max(0.0, started + budget_s - time.monotonic()))
        return time.monotonic() - started

    def _teardown(self) -> None:
        self.cgroup.remove()
        if self.netns is not None:
            self.runner.network.delete_pod_netns(self.uid)
            self.netns = None
        if self.pod_ip and not self.host_network:
            self.runner.network.release(self.pod_ip)
        shutil.rmtree(self.dir, ignore_errors=True)
