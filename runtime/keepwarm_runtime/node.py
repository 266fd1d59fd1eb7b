"""The node process of `keepwarm cache serve`: the cache daemons, their /metrics, the snapshot
service and the node agent.

The daemon (cache/daemon.py) knows nothing of Kubernetes and the node agent (agent/kubernetes.py)
drives the daemons it is handed; this module composes them. It builds one daemon per GPU
(cache/gpus.py; one for the host tier), claims their sockets before anything is loaded (a second
daemon stops there), loads the initial models and adapters, binds, serves one /metrics for all of
them when there are several, runs the snapshot service (snapshot/service.py) beside them with
``--snapshot-store`` (a node without CRIU serves the cache alone, saying why), and runs the agent
with ``--report-to-kubernetes``. A daemon that ends ends the others, except after a hand-off, when
each waits for its own successor's commit.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from keepwarm_api.settings import carry_over
from keepwarm_runtime.cache.settings import CacheServeSettings

if TYPE_CHECKING:
    from keepwarm_runtime.cache.daemon import CacheDaemon, DaemonConfig
    from keepwarm_runtime.snapshot.service import SnapshotService
    from keepwarm_runtime.weights.tensor_parallel import Sharding

log = logging.getLogger("keepwarm_runtime.cache.serve")


class ServeRefused(Exception):
    """The node process cannot start; the message names why (the CLI prints it on one line)."""


def retire(after_handoff: str, ended: threading.Event) -> None:
    """After a hand-off: return (the process exits) or, with ``wait``, idle until SIGTERM (a pod's
    container that exited would be restarted and take everything back from its successor)."""
    if after_handoff == "wait":
        log.info("handed off to a successor; waiting idle for SIGTERM (--after-handoff wait)")
        ended.wait()


def daemon_config(settings: CacheServeSettings) -> DaemonConfig:
    """The daemon's configuration: the settings' same-named fields, the socket dir and the limits."""
    from keepwarm_runtime.cache.daemon import DaemonConfig
    from keepwarm_runtime.cache.limits import ServerLimits

    assert settings.socket_dir is not None  # required: resolve() refuses settings without it
    limits = ServerLimits(
        settings.max_connections, settings.max_connections_per_uid, settings.request_deadline
    )
    quantization = None if settings.quantization == "none" else settings.quantization
    return carry_over(
        settings, DaemonConfig, socket_dir=Path(settings.socket_dir), limits=limits, quantization=quantization
    )


def daemon_configs(settings: CacheServeSettings) -> list[DaemonConfig]:
    """One configuration per daemon to run (cache/gpus.py): the one, or one per (fake) GPU."""
    from keepwarm_runtime.cache.gpus import DaemonPlan, discover, plan_daemons

    base = daemon_config(settings)
    plans = plan_daemons(base.tier, settings.all_gpus, settings.fake_gpus, discover)
    if len(plans) == 1 and plans[0] == DaemonPlan(plans[0].tier, None):
        return [dataclasses.replace(base, tier=plans[0].tier)]  # the one daemon, with its own /metrics
    port = None  # several daemons: one /metrics for all (serve_per_gpu), not one each
    return [
        dataclasses.replace(
            base,
            tier=p.tier,
            device=p.device or base.device,
            fake_gpu_uuid=p.fake_gpu_uuid,
            metrics_port=port,
        )
        for p in plans
    ]


def serve(settings: CacheServeSettings) -> int:
    """Claim the sockets, load the models and adapters, serve until SIGTERM (0). ServeRefused, naming
    why, on bad settings or when none of the models loads (an adapter that fails is logged and
    Failed, like a model)."""
    from keepwarm_runtime.cache.adapters import KIND_ADAPTER
    from keepwarm_runtime.cache.daemon import CacheDaemon
    from keepwarm_runtime.cache.gpus import held_ranks
    from keepwarm_runtime.weights.tensor_parallel import Sharding

    if settings.report_to_kubernetes and not (settings.weightcache and settings.node_name):
        raise ServeRefused("--report-to-kubernetes needs --weightcache and --node-name")
    if settings.stall_timeout < 1:
        raise ServeRefused("--stall-timeout must be at least 1 second")
    daemons: list[CacheDaemon] = []

    def close_all() -> None:
        for d in daemons:
            d.close()

    try:
        for config in daemon_configs(settings):
            daemons.append(CacheDaemon(config))
            daemons[-1].claim()  # a second daemon stops here, before loading anything
    except Exception as exc:  # bad tier/device/group/socket dir, no CUDA, no GPU, lock held: one line
        close_all()
        if settings.report_to_kubernetes:
            from keepwarm_runtime.agent.kubernetes import report_start_failure

            report_start_failure(settings, f"{type(exc).__name__}: {exc}")
        raise ServeRefused(exc) from exc
    quantization = daemons[0].config.quantization
    for index, daemon in enumerate(daemons):
        shardings = [
            Sharding(rank, settings.tensor_parallel_size, settings.enable_expert_parallel)
            for rank in held_ranks(index, len(daemons), settings.tensor_parallel_size)
        ]
        loaded = load_initial_models(daemon, list(settings.model), quantization, shardings=shardings)
        load_initial_models(daemon, list(settings.adapters), kind=KIND_ADAPTER)
        if settings.model and not loaded:
            close_all()
            raise ServeRefused(f"none of the {len(settings.model)} models loaded; see the errors above")
    try:
        for daemon in daemons:
            daemon.bind()
    except Exception as exc:
        close_all()
        raise ServeRefused(exc) from exc
    if settings.metrics_port is not None and daemons[0].config.metrics_port is None:  # per GPU
        from keepwarm_runtime.cache.metrics import serve_per_gpu

        registries = {d.serves_gpu or "": d.metrics.registry for d in daemons}
        serve_per_gpu(registries, settings.metrics_port, took_over=any(d.took_over for d in daemons))

    ended = threading.Event()  # SIGTERM (or SIGINT)
    snapshots = start_snapshot_service(settings, daemons[0])

    def stop_all(*_: object) -> None:
        for d in daemons:
            d.stop()
        if snapshots is not None:
            snapshots.stop()

    def on_signal(*_: object) -> None:
        ended.set()
        stop_all()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if settings.report_to_kubernetes:
        from keepwarm_runtime.agent.kubernetes import run_agent

        threading.Thread(
            target=run_agent, args=(daemons, settings, None, snapshots), daemon=True, name="node-agent"
        ).start()
    others = [
        threading.Thread(target=_serve_then_stop_all, args=(d, stop_all), name=f"daemon-{d.serves_gpu}")
        for d in daemons[1:]
    ]
    for thread in others:
        thread.start()
    _serve_then_stop_all(daemons[0], stop_all)
    for thread in others:
        thread.join()
    if all(d.handed_off for d in daemons):
        retire(settings.after_handoff, ended)
    return 0


def start_snapshot_service(settings: CacheServeSettings, daemon: CacheDaemon) -> SnapshotService | None:
    """The snapshot service in the daemons' socket directory, with their group and peer policy,
    serving in a thread; None without --snapshot-store, or when it cannot start (logged: no CRIU, a
    store it cannot write): the cache serves all the same."""
    if settings.snapshot_store is None:
        return None
    from keepwarm_runtime.cache.security import resolve_gid
    from keepwarm_runtime.snapshot.criu import CriuMissing
    from keepwarm_runtime.snapshot.service import ServiceSettings, SnapshotService

    service = SnapshotService(
        ServiceSettings(
            socket_dir=daemon.socket_dir,
            store=Path(settings.snapshot_store),
            criu=settings.criu,
            budget=settings.snapshot_budget,
            gid=resolve_gid(settings.group),
            policy=daemon.policy,
            preload_timeout=settings.snapshot_preload_timeout,
            log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()),
        )
    )
    try:
        service.bind()
    except (CriuMissing, OSError, ValueError) as exc:
        log.warning("no snapshot service (runtime pods will import): %s", exc)
        service.stop()
        return None
    threading.Thread(target=service.serve_forever, daemon=True, name="snapshot-service").start()
    return service


def _serve_then_stop_all(daemon, stop_all) -> None:
    """Serve one daemon; when it ends (SIGTERM, or its server failed) the others end too, except
    after a hand-off: each of the others then waits for its own successor's commit."""
    try:
        daemon.serve_forever()
    finally:
        if not daemon.handed_off:
            stop_all()


def load_initial_models(
    daemon,
    paths: list[str],
    quantization: str | None = None,
    kind: str | None = None,
    shardings: list[Sharding] | None = None,
) -> list[str]:
    """Load each model (or LoRA adapter, by ``kind``) without evicting another (a model quantized
    online when ``quantization`` is set; as each of ``shardings``' shards when given); a failure is an
    ERROR line (or a WARNING when it only does not fit the budget) and a Failed entry, never the end
    of the daemon."""
    from keepwarm_runtime.cache.adapters import KIND_MODEL
    from keepwarm_runtime.cache.registry import BudgetExceeded
    from keepwarm_runtime.weights.tensor_parallel import WHOLE

    loaded = []
    for path in paths:
        for sharding in shardings or [WHOLE]:
            try:
                loaded.append(
                    daemon.add_model(
                        path,
                        evict=False,
                        quantization=quantization,
                        kind=kind or KIND_MODEL,
                        sharding=sharding,
                    )
                )
            except BudgetExceeded as exc:
                log.warning("not loading %s: %s", path, exc)
            except Exception as exc:
                log.error("cannot load %s: %s", path, exc)
    return loaded
