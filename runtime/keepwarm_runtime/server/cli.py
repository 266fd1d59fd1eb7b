"""`keepwarm serve MODEL_DIR`: the OpenAI-compatible server.

Flags, KEEPWARM_* variables and --help come from one declaration, ``server/settings.py``
(``--max-num-seqs`` <- ``KEEPWARM_MAX_NUM_SEQS``; MODEL_DIR <- ``KEEPWARM_MODEL_DIR``); a flag on the
command line wins, an empty variable means the default. This is how the operator configures pods.
The parsed arguments become one ServeSettings here, at the entry point, and its engine settings one
EngineConfig (``engine_config``) that the background attach, the engine and the speech engine all
take; everything below takes those two. Imports stay lazy: `keepwarm --help` must not pay for torch.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from keepwarm_api.settings import SettingError, add_command, env_names, group, resolve
from keepwarm_api.shutdown import DRAIN_S
from keepwarm_runtime.engine.auto_dtype import AUTO_DTYPE, auto_dtype
from keepwarm_runtime.engine.config import EngineConfig
from keepwarm_runtime.engine.parallel.launch import NodeShare, node_rendezvous
from keepwarm_runtime.model_kind import ModelKind, detect_kind
from keepwarm_runtime.server import listener
from keepwarm_runtime.server.settings import ENGINE, ServeSettings

if TYPE_CHECKING:
    from keepwarm_runtime.engine.prefetch import WeightPrefetch

logger = logging.getLogger(__name__)


def serve_env_vars() -> frozenset[str]:
    """Every environment variable `keepwarm serve` reads."""
    return env_names(ServeSettings)


def register(subparsers: argparse._SubParsersAction) -> None:
    add_serve_parser(subparsers)


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return add_command(
        subparsers, "serve", ServeSettings, "serve MODEL_DIR over an OpenAI-compatible HTTP API", run
    )


def parse_serve_argv(argv: Sequence[str]) -> argparse.Namespace:
    """`keepwarm serve ARGV` as the serve parser alone parses it (SystemExit 2 on a flag it refuses)."""
    parser = argparse.ArgumentParser(prog="keepwarm")
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def serve_settings(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> ServeSettings:
    """The one ServeSettings of this process: flags, else KEEPWARM_* variables, else defaults.

    A value that does not parse (or a missing MODEL_DIR) is a SystemExit naming the flag or variable."""
    try:
        return resolve(ServeSettings, args, environ)
    except SettingError as exc:
        raise SystemExit(f"keepwarm serve: {exc}") from None


def engine_config(settings: ServeSettings) -> EngineConfig:
    """The one EngineConfig of this process: the engine group's set fields, named in its ``given``
    (unset ones keep EngineConfig's defaults), and --kernel-cache, for the absolute MODEL_DIR.

    ``--dtype auto`` becomes a dtype here (engine/auto_dtype.py), so everything that takes this config
    (the background attach, the engine, the speech engine) sees a real one; the choice is logged.
    --lora-modules, --lora-modules-file or --allow-runtime-lora-updating turn LoRA on unless
    --enable-lora says otherwise. A value EngineConfig refuses is a ValueError naming the field.
    """
    if settings.model_dir is None:
        raise ValueError("MODEL_DIR is required")
    engine = group(settings, ENGINE)
    if engine.get("dtype") == AUTO_DTYPE:
        engine["dtype"], why = auto_dtype(settings.model_dir, engine.get("device"))
        logger.info("--dtype auto: %s (%s)", engine["dtype"], why)
    if settings.lora_modules or settings.lora_modules_file or settings.allow_runtime_lora_updating:
        engine.setdefault("enable_lora", True)
    config = EngineConfig.from_settings(os.path.abspath(settings.model_dir), **engine)
    # Where the pod mounts the node's kernel builds, not an engine choice: not in `given`, so an engine
    # that builds no kernel (Whisper's) is not refused it.
    return replace(config, kernel_cache=settings.kernel_cache)


def server_start(config: ServeSettings, thread_choice: Any, openmp_prepared: bool) -> ServerStart:
    """What serving needs, decided once: the EngineConfig (``engine_config``; its ValueError passes
    through) and what kind of model its directory holds."""
    engine = engine_config(config)
    return ServerStart(config, engine, detect_kind(engine.model_dir), thread_choice, openmp_prepared)


def run(args: argparse.Namespace) -> int:
    """The handler of `keepwarm serve`: resolve the settings once, then serve them."""
    try:
        settings = serve_settings(args)
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return 2
    return serve(settings)


def prepare_parent_environment() -> None:
    """What the supervising parent sets before torch loads: numpy's OpenBLAS starts its thread pool
    when torch loads it; the serving path does no numpy BLAS, and the parent must fork with one
    thread only. (A snapshot's parent, server/checkpoint.py, does the same.)"""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def start_from_snapshot(config: ServeSettings) -> int | None:
    """Before any heavy import: restore this start's supervising parent from the node's snapshot
    (snapshot/restore.py) and stay its init; returns its exit code once it ended. None: this process
    serves itself (it imports, also in place of a restored parent that failed unasked; or it is the
    restored parent), with how it started recorded (snapshot/outcome.py) for the metrics."""
    from keepwarm_runtime.snapshot import outcome

    if outcome.recorded() is not None:  # the restored parent, running `keepwarm serve` itself
        return None
    if config.snapshot_store is None or not config.supervise:
        reason = outcome.Reason.OFF if config.snapshot_store is None else outcome.Reason.UNSUPERVISED
        outcome.record(outcome.StartupSource(outcome.Source.IMPORTS, reason))
        return None
    from keepwarm_runtime.snapshot.key import preload_device
    from keepwarm_runtime.snapshot.restore import LaunchSettings, Restored, launch, leave_init, stay_init

    assert config.model_dir is not None  # required: resolve() refuses settings without it
    result = launch(
        LaunchSettings(
            store=Path(config.snapshot_store),
            criu=config.criu,
            model_dir=os.path.abspath(config.model_dir),
            device=preload_device(config.device),
            socket_dir=config.cache_socket_dir,
            restore_timeout=config.restore_timeout,
            listener=listener.held(),
        )
    )
    if isinstance(result, Restored):
        listener.give_up()  # handed to the restored parent (or never bound): this init holds no copy
        outcome.record(result.outcome)
        ended = stay_init(result.pid)
        if not ended.unasked:
            return ended.code
        logger.error("the restored parent failed unasked (exit %d): importing in its place", ended.code)
        leave_init()
        result = outcome.StartupSource(outcome.Source.IMPORTS, outcome.Reason.RESTORED_EXITED)
    outcome.record(result)
    return None


def serve(config: ServeSettings) -> int:
    """Serve until stopped: through a supervising parent (server/supervisor.py) unless --no-supervise,
    restored from a snapshot when --snapshot-store holds one for this start.

    2 on bad settings, 1 if loading fails."""
    from keepwarm_runtime.engine import threads as cpu_threads
    from keepwarm_runtime.snapshot import outcome

    if config.supervise and node_share(config).serves:  # before a restore: server/listener.py
        listener.bind_early(config.host, config.port)
    if (code := start_from_snapshot(config)) is not None:
        return code
    # Before anything imports torch: OpenMP reads its thread count and wait policy once, at load.
    try:
        thread_choice = cpu_threads.choose_threads(config.threads)
    except ValueError as exc:
        print(f"keepwarm serve: {exc}", file=sys.stderr)
        return 2
    ranks = config.tensor_parallel_size or 1
    if (refusal := parallel_refusal(config, ranks)) is not None:
        print(f"keepwarm serve: {refusal}", file=sys.stderr)
        return 2
    if not (config.device or "cpu").startswith("cuda"):  # this node's ranks share its cores
        thread_choice = cpu_threads.per_rank(thread_choice, node_share(config).local)
    started = outcome.recorded()
    # A restored parent's OpenMP was loaded by the snapshot's preload, with this pod's variables.
    restored = started is not None and started.source is outcome.Source.SNAPSHOT
    openmp_prepared = cpu_threads.prepare_openmp(thread_choice) or restored
    if config.supervise:
        prepare_parent_environment()
    from keepwarm_runtime.process_start import process_start_time

    started_at = process_start_time()
    assert config.model_dir is not None  # required: resolve() refuses settings without it
    if not os.path.isdir(config.model_dir):
        print(f"keepwarm serve: {config.model_dir} is not a directory", file=sys.stderr)
        return 2
    if config.lora_modules_file is not None:
        from keepwarm_runtime.server.base.lora_modules import parse_lora_modules_file

        try:  # refused at start; a later bad content only leaves the served adapters as they are
            parse_lora_modules_file(Path(config.lora_modules_file).read_text(), config.lora_modules_file)
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            print(f"keepwarm serve: --lora-modules-file: {exc}", file=sys.stderr)
            return 2
    try:
        server = server_start(config, thread_choice, openmp_prepared)
    except ValueError as exc:
        print(f"keepwarm serve: {exc}", file=sys.stderr)
        return 2
    if config.supervise:
        return supervise(server)
    # The weights need only torch: attach them while the server and transformers import.
    return server.run(started_at, server.prefetch())


def node_share(config: ServeSettings) -> NodeShare:
    """The ranks of the group this node (pod) runs (--nnodes, --node-rank)."""
    return NodeShare(config.tensor_parallel_size or 1, config.nnodes, config.node_rank)


def parallel_refusal(config: ServeSettings, ranks: int) -> str | None:
    """Why these settings cannot run ``ranks`` tensor-parallel ranks (None: they can)."""
    if (refusal := node_share(config).refusal(config.master_addr)) is not None:
        return refusal
    if config.headless and config.node_rank == 0:
        return "--headless: node rank 0 serves the API (only the nodes above it run headless)"
    if ranks == 1:
        return None
    if not config.supervise:
        return (
            "--tensor-parallel-size needs the supervising parent, which forks the ranks (drop --no-supervise)"
        )
    if config.enable_sleep_mode:
        return "--enable-sleep-mode is not served with --tensor-parallel-size > 1"
    from keepwarm_runtime.engine.parallel.launch import device_refusal

    return device_refusal(config.device or "cpu", node_share(config).local)


def supervise(server: ServerStart) -> int:
    """Import everything and bind the ports here, then serve in forked workers (server/supervisor.py);
    a tensor-parallel engine as a group of ranks (engine/parallel), all forked here."""
    import itertools
    import shutil
    import tempfile
    import time

    from keepwarm_runtime.server.preload import preload
    from keepwarm_runtime.server.supervisor import RESTARTS, Supervisor, SupervisorConfig, bind_listener

    config = server.config
    if server.check() is not None:
        return 2
    preload(server.model_dir, server.kind, cuda=server.engine_config.device.startswith("cuda"))
    ranks = server.engine_config.tensor_parallel_size
    if ranks > 1 and (refusal := server.split_refusal()) is not None:
        print(f"keepwarm serve: {refusal}", file=sys.stderr)
        return 2
    share = node_share(config)
    health_port = config.supervisor_port if config.supervisor_port is not None else config.port + 1
    try:  # a node without rank 0 serves no API: only the parent's /health
        api = listener.take(config.port) or bind_listener(config.host, config.port) if share.serves else None
        health = bind_listener(config.host, health_port, backlog=16)
    except OSError as exc:
        print(
            f"keepwarm serve: cannot listen on {config.host}:{config.port}/{health_port}: {exc}",
            file=sys.stderr,
        )
        return 2

    # one rendezvous directory for the parent's life; each group start meets at a fresh file in it;
    # a group over nodes meets at rank 0's store, once (it restarts as a whole, by pods)
    spans_nodes = share.nnodes > 1
    directory = tempfile.mkdtemp(prefix="keepwarm-tp-") if ranks > 1 and not spans_nodes else None
    starts = itertools.count()

    def rendezvous() -> str:
        if spans_nodes:
            assert config.master_addr is not None  # parallel_refusal
            return node_rendezvous(config.master_addr, config.master_port)
        return f"file://{directory}/group-{next(starts)}"

    def worker(rank: int, meet_at: str | None) -> int:
        started_at = time.time()  # the fork: this worker's start
        start = server if meet_at is None else server.for_rank(rank, meet_at, rank - share.first)
        if rank > 0:  # follows rank 0's steps; serves no HTTP
            if api is not None:
                api.close()
            return start.follow()
        prefetch = start.prefetch()  # the EngineConfig the parent built, inherited by the fork
        # A restarted worker loads before it accepts: requests wait in the backlog, never see a 503.
        return start.run(started_at, prefetch, api, load_first=sum(RESTARTS.by_cause.values()) > 0)

    supervisor = Supervisor(
        SupervisorConfig(
            host=config.host,
            port=config.port,
            health_timeout=config.worker_health_timeout,
            load_timeout=config.worker_load_timeout,
            max_failed_restarts=config.max_failed_restarts,
        ),
        worker,
        health,
        close_in_worker=[health],
        listener=api,
        ranks=share.local,
        rendezvous=rendezvous if ranks > 1 else None,
        first_rank=share.first,
        whole_group=not spans_nodes,
    )
    if share.serves:
        logger.info(
            "supervising: workers serve http://%s:%d; the parent's /health is on port %d",
            config.host,
            config.port,
            health_port,
        )
    else:
        logger.info(
            "supervising ranks %d..%d of %d (node %d of %d, no API); the parent's /health is on port %d",
            share.first,
            share.first + share.local - 1,
            ranks,
            config.node_rank,
            config.nnodes,
            health_port,
        )
    try:
        return supervisor.run()
    finally:
        if api is not None:
            api.close()
        health.close()
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)


def fast_io() -> tuple[str, str]:
    """uvicorn's event loop and HTTP parser: uvloop and httptools (runtime dependencies), or asyncio
    and h11 where they are missing (a stream's chunks then cost the event loop about a third more);
    named here rather than left to uvicorn's "auto", so the log says which the server runs."""
    import importlib.util

    loop = "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    http = "httptools" if importlib.util.find_spec("httptools") is not None else "h11"
    return loop, http


@dataclass
class ServerStart:
    """What serving needs once the settings are resolved (``server_start``); ``run`` serves in this
    process, and a supervised worker inherits it by the fork."""

    config: ServeSettings
    engine_config: EngineConfig  # built once (engine_config): the prefetch, the engine, the speech engine
    kind: ModelKind  # what model_dir holds, decided once (model_kind.detect_kind)
    thread_choice: Any  # engine.threads.ThreadChoice
    openmp_prepared: bool
    audio: Any = None  # AudioServerSettings once checked

    @property
    def model_dir(self) -> str:
        """The checkpoint directory, absolute."""
        return self.engine_config.model_dir

    def prefetch(self) -> WeightPrefetch:
        """Begin attaching this config's weights in the background (engine/prefetch.py)."""
        from keepwarm_runtime.engine.prefetch import WeightPrefetch

        return WeightPrefetch.start(self.engine_config, self.kind)

    def for_rank(self, rank: int, rendezvous: str, local_rank: int | None = None) -> ServerStart:
        """This start as rank ``rank`` of a tensor-parallel group meeting at ``rendezvous``, the
        ``local_rank``-th of the ranks on this node (its GPU)."""
        from keepwarm_runtime.engine.parallel.launch import rank_config

        return replace(self, engine_config=rank_config(self.engine_config, rank, rendezvous, local_rank))

    def split_refusal(self) -> str | None:
        """Why this model cannot be split over its ranks (None: it can), checked before any fork."""
        from keepwarm_runtime.engine.loader import ModelLoadError
        from keepwarm_runtime.engine.parallel.launch import refuse_unsplittable

        if self.kind is not ModelKind.TEXT:
            return f"a {self.kind.value} model is served on one rank only (--tensor-parallel-size)"
        try:
            refuse_unsplittable(self.engine_config)
        except ModelLoadError as exc:
            return str(exc)
        return None

    def follow(self) -> int:
        """A rank 1..N-1 of a tensor-parallel group: load its shard and follow rank 0's steps."""
        from keepwarm_runtime.engine import threads as cpu_threads
        from keepwarm_runtime.engine.parallel.launch import serve_rank

        cpu_threads.apply(self.thread_choice)
        return serve_rank(self.engine_config, self.prefetch())

    def make_engine(self, started_at: float, prefetch: WeightPrefetch, load_first: bool = False) -> Any:
        """The engine of this config: Whisper's for a speech model, else an LLMEngine that takes the
        weights ``prefetch`` attached, with the --lora-modules adapters added and (unless
        ``load_first``) warmed up."""
        # transformers resolves its names lazily: import what the engine uses now (the attention
        # registry and weight conversions pull torch._dynamo, torch.distributed.tensor and sympy, ~4 s
        # on a small CPU), so those seconds are charged to the imports phase, not to config.
        import transformers.core_model_loading  # noqa: F401
        from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401

        from keepwarm_runtime.engine.llm_engine import LLMEngine
        from keepwarm_runtime.engine.startup import StartupProfile
        from keepwarm_runtime.server.openai.audio.serving import make_speech_engine

        speech = make_speech_engine(self.engine_config, self.kind)
        if speech is not None:
            return speech
        profile = StartupProfile.since_process_start(started_at)
        profile.mark("imports")
        engine = LLMEngine(self.engine_config, profile, prefetch)
        for adapter in self.config.lora_modules:  # a bad adapter fails the start, naming it
            engine.add_lora(adapter.name, adapter.path)
        if not load_first:  # a restarted worker's first queued request is its warm-up
            engine.warm_up()
        return engine

    def check(self) -> int | None:
        """Validate the media and audio settings (2 and a message when they are wrong), else None."""
        from keepwarm_runtime.server.base.media_fetch import media_policy
        from keepwarm_runtime.server.openai.audio.serving import audio_settings

        config = self.config
        try:
            media = media_policy(
                config.allowed_media_domains,
                config.allowed_local_media_path,
                config.max_audio_upload_bytes,
                config.media_fetch_timeout,
            )
            self.audio = audio_settings(config.audio_backend, config.max_audio_upload_bytes, self.kind, media)
        except (ValueError, RuntimeError) as exc:
            print(f"keepwarm serve: {exc}", file=sys.stderr)
            return 2
        return None

    def run(
        self,
        started_at: float,
        prefetch: WeightPrefetch,
        listener: socket.socket | None = None,
        load_first: bool = False,
    ) -> int:
        """Build the app and serve it (on ``listener`` if given, else bind host:port) until stopped.

        ``load_first`` (a restarted worker): accept connections only once the engine is loaded
        (create_app), and skip the warm-up request: clients are already waiting in the backlog, and
        a warm-up would only make the first of them wait one request longer."""
        import uvicorn

        from keepwarm_runtime.engine import threads as cpu_threads
        from keepwarm_runtime.server.app import create_app
        from keepwarm_runtime.server.base.serving import ServingOptions

        if self.audio is None and self.check() is not None:
            return 2
        config, model_dir = self.config, self.model_dir

        def make_engine() -> Any:
            return self.make_engine(started_at, prefetch, load_first)

        options = ServingOptions(
            trust_request_chat_template=config.trust_request_chat_template,
            tool_call_parser=config.tool_call_parser,
            preprocess_timeout_s=config.preprocess_timeout,
            max_request_body_bytes=config.max_request_body_bytes,
            api_key=config.api_key or None,
            lora_modules=config.lora_modules,
            lora_modules_file=config.lora_modules_file,
            allow_runtime_lora_updating=config.allow_runtime_lora_updating,
        )
        app = create_app(
            make_engine,
            model_dir=model_dir,
            served_model_name=config.served_model_name,
            started_at=started_at,
            options=options,
            audio=self.audio,
            load_before_serving=load_first,
            sleep_mode=config.enable_sleep_mode,
            wake_on_request=config.wake_on_request,
        )
        loop, http = fast_io()
        server = uvicorn.Server(
            uvicorn.Config(
                app,
                host=config.host,
                port=config.port,
                loop=loop,
                http=http,
                log_level=config.uvicorn_log_level,
                access_log=config.access_log,
                timeout_graceful_shutdown=DRAIN_S,
            )
        )
        async_engine = app.state.ctx.async_engine

        def stop_if_load_fails() -> None:
            async_engine.ready_event.wait()
            if async_engine.state == "failed":
                logger.error("exiting: the model could not be loaded (%s)", async_engine.error)
                server.should_exit = True

        threading.Thread(target=stop_if_load_fails, name="keepwarm-load-watch", daemon=True).start()
        logger.info(
            "intra-op threads: %d (%s; torch reports %d)%s",
            self.thread_choice.threads,
            self.thread_choice.reason,
            cpu_threads.apply(self.thread_choice),
            ""
            if self.openmp_prepared
            else "; torch was imported first, so OpenMP's wait policy is its default",
        )
        logger.info(
            "serving %s on http://%s:%d (engine settings: %s, api key %s; event loop %s, HTTP %s)",
            model_dir,
            config.host,
            config.port,
            self.engine_config.given_values(),
            "required" if options.api_key else "off",
            loop,
            http,
        )
        server.run(sockets=None if listener is None else [listener])
        return 1 if async_engine.state == "failed" else 0
