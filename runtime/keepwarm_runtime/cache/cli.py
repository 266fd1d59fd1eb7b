"""`keepwarm cache serve|ls|stats|release`: run the node daemon and inspect it from a shell.

Bad input never ends in a traceback: every command answers it with one line on stderr naming what
is wrong and exits with ``EXIT_BAD_INPUT`` (2). ``serve`` loads each ``--model`` on its own: a model
that fails is logged (and listed as Failed) while the others are served; it exits 2 only when models
were given and none loaded.

With ``--all-gpus`` (or the test twin ``--fake-gpu``, see cache/gpus.py) ``serve`` runs one daemon
per GPU in this process, each on its own gpu-<UUID>.sock, with one /metrics for all of them; the
node agent drives every one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from keepwarm_api.settings import SettingError, add_command, carry_over, resolve
from keepwarm_runtime.cache.settings import CacheHoldSettings, CacheServeSettings

if TYPE_CHECKING:
    from keepwarm_runtime.cache.daemon import DaemonConfig

log = logging.getLogger("keepwarm_runtime.cache.serve")
EXIT_BAD_INPUT = 2


class OneLineErrorParser(argparse.ArgumentParser):
    """Bad flags get one line naming the flag (and exit 2), not a usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: {message} (see --help)\n")


def register(subparsers: argparse._SubParsersAction) -> None:
    cache = subparsers.add_parser("cache", help="node weight cache daemon and inspection")
    sub = cache.add_subparsers(dest="cache_command", required=True, parser_class=OneLineErrorParser)

    add_command(
        sub, "serve", CacheServeSettings, "load checkpoints and serve them over a Unix socket", run_serve
    )
    add_command(
        sub,
        "hold",
        CacheHoldSettings,
        "keep the daemons' arena descriptors so that a crashed daemon restarts warm",
        run_hold,
    )

    for name, help_text in (("ls", "list resident models"), ("stats", "daemon statistics as JSON")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--socket", required=True, help="daemon socket path (e.g. DIR/host.sock)")
        p.set_defaults(handler=run_inspect, cache_cmd=name)
    release = sub.add_parser("release", help="drop a model from the daemon")
    release.add_argument("--socket", required=True)
    release.add_argument("model")
    release.add_argument("--force", action="store_true", help="release even a pinned model")
    release.set_defaults(handler=run_inspect, cache_cmd="release")


def _fail(command: str, message: object) -> int:
    print(f"keepwarm cache {command}: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def run_serve(args: argparse.Namespace) -> int:
    """The handler of `keepwarm cache serve`: resolve the settings once, then serve them."""
    try:
        settings = resolve(CacheServeSettings, args, os.environ)
    except SettingError as exc:
        return _fail("serve", exc)
    return serve(settings)


def run_hold(args: argparse.Namespace) -> int:
    """The handler of `keepwarm cache hold`: the descriptor holder (cache/holder.py) until SIGTERM."""
    from keepwarm_runtime.cache.holder import Holder

    try:
        settings = resolve(CacheHoldSettings, args, os.environ)
        assert settings.socket_dir is not None  # required: resolve() refuses settings without it
        holder = Holder(Path(settings.socket_dir), settings.group)
        holder.start()
    except Exception as exc:  # bad settings, socket dir or group, another uid's holder: one line
        return _fail("hold", exc)
    ended = threading.Event()

    def stop(*_: object) -> None:
        holder.stop()
        ended.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    holder.serve_forever()
    if holder.handed_off:
        retire(settings.after_handoff, ended)
    return 0


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
    """Claim the sockets, load the models and adapters, serve until SIGTERM; 2 on bad settings or when
    none of the models loads (an adapter that fails is logged and Failed, like a model)."""
    from keepwarm_runtime.cache.adapters import KIND_ADAPTER
    from keepwarm_runtime.cache.daemon import CacheDaemon

    if settings.report_to_kubernetes and not (settings.weightcache and settings.node_name):
        return _fail("serve", "--report-to-kubernetes needs --weightcache and --node-name")
    if settings.stall_timeout < 1:
        return _fail("serve", "--stall-timeout must be at least 1 second")
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
        return _fail("serve", exc)
    quantization = daemons[0].config.quantization
    for daemon in daemons:
        loaded = load_initial_models(daemon, list(settings.model), quantization)
        load_initial_models(daemon, list(settings.adapters), kind=KIND_ADAPTER)
        if settings.model and not loaded:
            close_all()
            return _fail("serve", f"none of the {len(settings.model)} models loaded; see the errors above")
    try:
        for daemon in daemons:
            daemon.bind()
    except Exception as exc:
        close_all()
        return _fail("serve", exc)
    if settings.metrics_port is not None and daemons[0].config.metrics_port is None:  # per GPU
        from keepwarm_runtime.cache.metrics import serve_per_gpu

        registries = {d.serves_gpu or "": d.metrics.registry for d in daemons}
        serve_per_gpu(registries, settings.metrics_port, took_over=any(d.took_over for d in daemons))

    ended = threading.Event()  # SIGTERM (or SIGINT)

    def stop_all(*_: object) -> None:
        for d in daemons:
            d.stop()

    def on_signal(*_: object) -> None:
        ended.set()
        stop_all()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if settings.report_to_kubernetes:
        from keepwarm_runtime.agent.kubernetes import run_agent

        threading.Thread(target=run_agent, args=(daemons, settings), daemon=True, name="node-agent").start()
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


def _serve_then_stop_all(daemon, stop_all) -> None:
    """Serve one daemon; when it ends (SIGTERM, or its server failed) the others end too, except
    after a hand-off: each of the others then waits for its own successor's commit."""
    try:
        daemon.serve_forever()
    finally:
        if not daemon.handed_off:
            stop_all()


def load_initial_models(
    daemon, paths: list[str], quantization: str | None = None, kind: str | None = None
) -> list[str]:
    """Load each model (or LoRA adapter, by ``kind``) without evicting another (a model quantized
    online when ``quantization`` is set); a failure is an ERROR line (or a WARNING when it only does
    not fit the budget) and a Failed entry, never the end of the daemon."""
    from keepwarm_runtime.cache.adapters import KIND_MODEL
    from keepwarm_runtime.cache.registry import BudgetExceeded

    loaded = []
    for path in paths:
        try:
            loaded.append(
                daemon.add_model(path, evict=False, quantization=quantization, kind=kind or KIND_MODEL)
            )
        except BudgetExceeded as exc:
            log.warning("not loading %s: %s", path, exc)
        except Exception as exc:
            log.error("cannot load %s: %s", path, exc)
    return loaded


def run_inspect(args: argparse.Namespace) -> int:
    from keepwarm_runtime.cache.client import CacheAttachError, connect, request
    from keepwarm_runtime.cache.protocol import ProtocolError

    header = {"cmd": "list" if args.cache_cmd == "ls" else args.cache_cmd}
    if args.cache_cmd == "release":
        header |= {"model": args.model, "force": args.force}
    try:
        with connect(Path(args.socket), timeout_s=10.0) as sock:
            reply, fds = request(sock, header)
        for fd in fds:
            os.close(fd)
        if args.cache_cmd == "ls":
            for row in reply["models"]:
                print(format_ls_row(row))
            return 0
    except CacheAttachError as exc:
        return _fail(args.cache_cmd, exc)
    except (ProtocolError, OSError) as exc:
        return _fail(args.cache_cmd, f"{args.socket} is not a keepwarm cache daemon ({exc})")
    except (KeyError, TypeError, ValueError) as exc:
        return _fail(args.cache_cmd, f"unexpected reply from {args.socket}: {type(exc).__name__}: {exc}")
    reply.pop("ok", None)
    print(json.dumps(reply, indent=2))
    return 0


def format_ls_row(m: dict) -> str:
    """One line per model: resident ones with size and key, Failed ones with their reason."""
    if m.get("state") == "Failed":
        return f"{m['name']}\tFailed\t{m['reason']}"
    pin = " pinned" if m["pinned"] else ""
    kind = m.get("kind", "model")
    return (
        f"{m['name']}\t{kind}\t{m['bytes'] / 2**20:.1f} MiB\t{m['tier']}\t{m['key_digest']}{pin}\t{m['path']}"
    )
