"""Restart benchmark: time to the first token, each load path in a fresh process.

A restart waits for load + one forward pass (lazy mmap loads only pay when the pass faults pages
in; dtype conversion is paid in full), so every path is timed from the start of loading to the
first logits, in a fresh process whose imports are done before the clock starts:

* ``hf_from_pretrained_s``: ``AutoModelForCausalLM.from_pretrained(dir, dtype=serving)``;
* ``disk_s``: the engine's own loader (``LLMEngine``: ``engine.loader.load_model`` reads the
  checkpoint with keepwarm's disk path into a meta-device model, then the tokenizer and a small KV
  cache; torch attention, so that no kernel compilation is timed) and its first step;
* ``warm_attach_s``: the same engine, attaching through a running daemon that holds the weights in the
  serving dtype (host tier: a memfd arena, mapped read-only and prefaulted with MAP_POPULATE).

Like for like with from_pretrained (which builds no tokenizer or KV cache): ``disk_model_load_s`` and
``warm_model_load_s`` are an engine path's config, model_meta and weights phases (engine/startup.py;
every phase is in ``breakdown_s``), ``hf_load_s`` from_pretrained's call; ``disk_over_hf_load`` is
their ratio and ``warm_model_load_over_attach_s`` what the warm path spends beyond the attach itself.

``forward_floor_s`` is a second forward pass (an engine step for the engine paths) in the same
process, weights mapped and cached: no load path can restart faster, so ``ratio_ceiling`` = hf /
floor bounds ``ratio`` on this machine. Each path's greedy first token must agree with the others'
(else ``first_tokens_differ``). Imports and one-time kernel setup happen before the clock, the
engine's through a tiny checkpoint loaded by the same engine code.
``process_cold_s`` / ``process_warm_s`` time whole processes (interpreter start and imports
included) on the disk path and the warm path. Every path runs ``--repeats`` times; the best run is
reported. Without ``--drop-caches`` the page cache is warm for every path (the checkpoint was just
written or read); with it (root only), ``sync; echo 3 > /proc/sys/vm/drop_caches`` runs before each
cold path (hf, disk and the cold server start), so those read the checkpoint, and the libraries the
process imports, from the disk itself.

``serve`` (on unless ``--no-serve``) times whole ``keepwarm serve`` starts to a 200 from /ready, each
a fresh server process with its default KV budget: ``disk_cold`` (page cache dropped; only with
``--drop-caches``), ``disk_warm`` (the checkpoint in the page cache) and ``cache`` (attached from
the running daemon). Each reports the server's own ``keepwarm_process_start_to_ready_seconds`` and
``keepwarm_startup_phase_seconds{phase}`` (engine/startup.py), the weights' source and attach time
(``keepwarm_weight_load_seconds``: the attach runs in the background during imports, so the weights
phase is only what the start still waited for it), and the wall time from spawn to the first 200
seen by polling.
``--snapshot`` (root, CRIU) adds ``snapshot``: whole `keepwarm serve` starts in a pod's namespaces
(keepwarm_runtime.server.launcher.POD), weights from the same daemon, spawn to a 200 from /ready:
``imports_ready_s`` (the parent imports) and ``snapshot_ready_s`` (the parent restored from the
snapshot the daemon's snapshot service took for the first start), each the best of --repeats with
every run, the restored starts' ``restore_s`` (keepwarm_startup_phase_seconds{phase="restore"}: the
pod's start until the restored parent resumed) and every start's ``worker_ready_s`` (its worker's
fork to ready).
Run: ``keepwarm bench restart --size-gib 2 --serving-dtype float32 --json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from keepwarm_api.settings import SettingError, add_arguments, resolve
from keepwarm_runtime.bench_cli import RestartSettings
from keepwarm_runtime.cache.backends.host import page_facts
from keepwarm_runtime.cache.launcher import DaemonProcess
from keepwarm_runtime.server.launcher import POD, start_server, stop_pod

CHECKPOINT_DTYPE = "bfloat16"
PROMPT_LEN = 4  # a short prompt: the pass reads every weight once
CHILD = [sys.executable, "-m", "bench.restart"]
REPO = Path(__file__).resolve().parents[1]
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
READY_METRIC = "keepwarm_process_start_to_ready_seconds"
PHASE_METRIC = "keepwarm_startup_phase_seconds"
LOAD_METRIC = "keepwarm_weight_load_seconds"


def checkpoint_for(size_gib: float, root: Path) -> Path:
    """A Llama checkpoint of about ``size_gib`` GiB in bfloat16, generated once and reused."""
    path = root / f"llama-{size_gib:g}gib-{CHECKPOINT_DTYPE}"
    if (path / "model.safetensors.index.json").exists():
        return path
    from keepwarm_runtime.modelgen import make_model

    params = int(size_gib * 2**30 / 2)
    shards = max(1, round(size_gib * 2))  # ~512 MiB shards, like hub checkpoints
    tmp = path.with_name(path.name + ".tmp")
    make_model(tmp, arch="llama", params=params, dtype=CHECKPOINT_DTYPE, num_shards=shards)
    tmp.rename(path)
    return path


# -- child side: one load path in this (fresh) process -------------------------------------------


KV_BLOCKS = 8  # the engine's KV cache: enough for the prompt, small so that allocating it costs ~nothing


def tiny_checkpoint(root: Path) -> Path:
    """A tiny Llama checkpoint the children load before the clock, warming the engine's code paths."""
    path = root / "llama-warmup"
    if not (path / "model.safetensors.index.json").exists():
        from keepwarm_runtime.modelgen import make_model

        tmp = path.with_name(path.name + ".tmp")
        make_model(tmp, arch="llama", params="1M", dtype=CHECKPOINT_DTYPE, num_shards=1)
        tmp.rename(path)
    return path


def _engine(model_dir: str, dtype_name: str, device: str, socket_dir: str | None):
    """An LLMEngine as `keepwarm serve` builds one; socket_dir None reads the checkpoint from disk."""
    from keepwarm_runtime.engine.config import EngineConfig
    from keepwarm_runtime.engine.llm_engine import LLMEngine

    config = EngineConfig(
        model_dir,
        dtype=dtype_name,
        device=device,
        cache_socket_dir=socket_dir,
        cache_fallback=False,
        num_kv_blocks=KV_BLOCKS,
        attention_backend="torch",
    )
    return LLMEngine(config)


def _first_token(engine, ids: list[int], request_id: str) -> int:
    """One greedy token through the engine's scheduler, runner and sampler."""
    from keepwarm_runtime.engine.sampling_params import SamplingParams

    engine.add_request(request_id, ids, SamplingParams(temperature=0.0, max_tokens=1))
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return out.outputs[0].token_ids[0]


def run_child(
    mode: str,
    model_dir: str,
    dtype_name: str,
    socket_dir: str | None,
    device: str = "cpu",
    threads: int = 0,
    warmup_dir: str | None = None,
) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.set_grad_enabled(False)
    if threads > 0:
        torch.set_num_threads(threads)
    dtype = getattr(torch, dtype_name)
    prompt = list(range(1, PROMPT_LEN + 1))
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    # Imports and one-time kernel setup are not part of a load path: do them before the clock
    # (transformers imports the modelling module lazily; the first matmul initialises oneDNN).
    # The HF path warms up on a tiny model of the same architecture; the engine paths run the
    # engine itself on a tiny checkpoint (same loader, attention, scheduler and sampler code).
    if mode == "hf":
        config = AutoConfig.from_pretrained(model_dir)
        tiny = AutoConfig.for_model(
            config.model_type,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=128,
        )
        warmup = AutoModelForCausalLM.from_config(tiny, dtype=dtype).to(device)
        warmup(torch.arange(1, 5, device=device).view(1, -1))
    elif warmup_dir is not None:
        _first_token(_engine(warmup_dir, dtype_name, device, None), prompt, "warmup")
    sync()
    started = time.perf_counter()
    source, reason, attach_s, phases = "hf", None, None, {}
    if mode == "hf":
        kwargs = {"device_map": device} if device != "cpu" else {}
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **kwargs)
        ids = torch.tensor([prompt], device=device)

        def first() -> int:
            return int(model(ids).logits[0, -1].argmax())
    else:
        engine = _engine(model_dir, dtype_name, device, socket_dir if mode == "warm" else None)
        source, reason, attach_s = engine.load_info.source, engine.load_info.reason, engine.load_info.seconds
        phases = dict(engine.startup.seconds)
        steps = iter(range(1 << 30))

        def first() -> int:
            return _first_token(engine, prompt, f"r{next(steps)}")

    sync()
    loaded = time.perf_counter()
    token = first()
    sync()
    done = time.perf_counter()
    first()  # the same pass again, every page mapped: what a restart pays even at zero load cost
    sync()
    steady = time.perf_counter() - done
    return {
        "mode": mode,
        "source": source,
        "reason": reason,
        "seconds": done - started,
        "load_s": loaded - started,
        "attach_s": attach_s,
        "forward_s": done - loaded,
        "steady_forward_s": steady,
        "token0": token,
        "phases": phases,
    }


def _child_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--child", required=True, choices=["hf", "disk", "warm"])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--socket-dir", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--warmup-model", default=None)
    a = p.parse_args(argv)
    result = run_child(a.child, a.model, a.dtype, a.socket_dir, a.device, a.threads, a.warmup_model)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


# -- parent side -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Paths:
    """What every child of one run shares."""

    model: Path  # the checkpoint
    warmup: Path  # the tiny checkpoint engine children load before the clock
    settings: RestartSettings


def snapshot_refusal(euid: int, criu: str) -> str | None:
    """Why ``--snapshot`` cannot run here (None: it can): pods' namespaces take root, and CRIU."""
    if euid != 0:
        return (
            f"--snapshot needs root (each start runs in a pod's namespaces); this process runs as uid {euid}"
        )
    if shutil.which(criu) is None:
        return f"--snapshot: no CRIU {criu!r} (scripts/criu/build.sh builds one and prints its directory)"
    return None


def drop_caches_refusal(euid: int, control: Path = DROP_CACHES) -> str | None:
    """Why ``--drop-caches`` cannot run here (None: it can): writing ``control`` takes root and a
    writable /proc/sys (containers often mount it read-only)."""
    if euid != 0:
        return f"--drop-caches needs root (it writes {control}); this process runs as uid {euid}"
    if not os.access(control, os.W_OK):
        return f"--drop-caches: {control} is not writable here (read-only /proc/sys?)"
    return None


def drop_page_cache() -> None:
    """Write dirty pages back, then drop clean page cache, dentries and inodes: the next read of the
    checkpoint (and of torch's libraries) comes from the disk."""
    os.sync()
    DROP_CACHES.write_text("3\n")


def _spawn(mode: str, paths: Paths, socket_dir: Path | None) -> tuple[dict, float]:
    """Run one child; returns (its result, whole-process wall seconds up to the result line)."""
    s = paths.settings
    cmd = [*CHILD, "--child", mode, "--model", str(paths.model), "--dtype", s.serving_dtype]
    cmd += ["--device", s.device, "--threads", str(s.threads), "--warmup-model", str(paths.warmup)]
    if socket_dir is not None:
        cmd += ["--socket-dir", str(socket_dir)]
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    }
    # stderr goes to a file: a pipe read only after stdout could fill (64 KiB of warnings) and stall
    # the child while this loop waits on its stdout.
    with tempfile.TemporaryFile("w+") as err:
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=REPO, env=env)
        result = None
        for line in proc.stdout:
            if line.startswith("RESULT "):
                wall = time.perf_counter() - started
                result = json.loads(line[7:])
        proc.wait()
        if proc.returncode != 0 or result is None:
            err.seek(0)
            raise RuntimeError(f"bench child {mode} failed (rc {proc.returncode}):\n{err.read()[-3000:]}")
    return result, wall


def _best(mode: str, paths: Paths, socket_dir: Path | None = None, cold: bool = False) -> dict:
    """Best of --repeats fresh children; ``cold``: drop the page cache before each (--drop-caches)."""
    runs = []
    for _ in range(paths.settings.repeats):
        if cold:
            drop_page_cache()
        runs.append(_spawn(mode, paths, socket_dir))
    best = min(runs, key=lambda r: r[0]["seconds"])
    return best[0] | {"process_s": min(r[1] for r in runs)}


def serve_args(settings: RestartSettings, socket_dir: Path | None) -> list[str]:
    """`keepwarm serve` flags for one timed start: the bench's dtype, device and threads; with
    ``socket_dir`` the weights must come from that cache (no silent fall back to disk)."""
    args = ["--dtype", settings.serving_dtype, "--device", settings.device]
    if settings.threads > 0:
        args += ["--threads", str(settings.threads)]
    if socket_dir is not None:
        args += ["--cache-socket-dir", str(socket_dir), "--no-cache-fallback"]
    return args


def startup_report(metrics: dict[str, float]) -> dict:
    """Ready time, phases, and the weights' source and attach time out of one server's /metrics.

    ``attach_s`` is the attach's own wall time: the server attaches in the background during its
    imports (engine/prefetch.py), so the ``weights`` phase is only what the start still waited."""
    phases = {
        key.split('phase="', 1)[1].rstrip('"}'): round(value, 3)
        for key, value in metrics.items()
        if key.startswith(PHASE_METRIC + "{")
    }
    loads = {
        key.split('source="', 1)[1].rstrip('"}'): round(value, 3)
        for key, value in metrics.items()
        if key.startswith(LOAD_METRIC + "{")
    }
    (source, attach_s), *more = loads.items() or [(None, None)]
    return {
        "ready_s": round(metrics[READY_METRIC], 3),
        "phases_s": phases,
        "weights_source": source if not more else sorted(loads),
        "attach_s": attach_s,
    }


def _serve_once(settings: RestartSettings, model: Path, socket_dir: Path | None, log: Path) -> dict:
    server = start_server(model, log, args=serve_args(settings, socket_dir))
    try:
        wall = server.wait("/ready", timeout=900)
        return startup_report(server.metrics()) | {"wall_to_ready_s": round(wall, 3)}
    finally:
        server.stop()


def _serve_best(
    settings: RestartSettings, model: Path, log_dir: Path, socket_dir: Path | None, cold: bool
) -> dict:
    """Best (by the server's own ready time) of --repeats server starts, every one in the report."""
    runs = []
    for i in range(settings.repeats):
        if cold:
            drop_page_cache()
        runs.append(_serve_once(settings, model, socket_dir, log_dir / f"serve-{len(runs)}-{i}.log"))
    best = min(runs, key=lambda r: r["ready_s"])
    return best | {"ready_s_runs": [r["ready_s"] for r in runs]}


def _pod_start(settings: RestartSettings, model: Path, args: list[str], log: Path, source: str) -> dict:
    """One `keepwarm serve` in a pod's namespaces: spawn to /ready, and how its parent started."""
    server = start_server(model, log, args=args, prefix=POD)
    try:
        wall = server.wait("/ready", timeout=900)
        metrics = server.metrics()
    finally:
        stop_pod(server.proc)  # the whole pod gone before the next start
    started = [k for k, v in metrics.items() if k.startswith("keepwarm_startup_source_total{") and v == 1]
    if not started or f'source="{source}"' not in started[0]:
        raise RuntimeError(f"a start meant to come from {source} came from {started}: see {log}")
    restore = metrics.get('keepwarm_startup_phase_seconds{phase="restore"}')
    return {
        "ready_s": round(wall, 3),
        "restore_s": None if restore is None else round(restore, 3),
        "worker_ready_s": round(metrics[READY_METRIC], 3),  # the worker's fork to ready
    }


def snapshot_starts(settings: RestartSettings, model: Path, logs: Path, socket_dir: Path, store: Path,
                    criu: str, daemon: DaemonProcess) -> dict:  # fmt: skip
    """``imports_ready_s`` and ``snapshot_ready_s`` (see the module docstring); the first start imports
    and asks the daemon for the snapshot the others restore."""
    imports_args = serve_args(settings, socket_dir)
    snapshot_args = [*imports_args, "--snapshot-store", str(store), "--criu", criu]
    _pod_start(settings, model, snapshot_args, logs / "snapshot-first.log", "imports")
    deadline = time.monotonic() + 900
    while not (
        took := [line for line in daemon.lines if "snapshots: took" in line or "no snapshot of" in line]
    ):
        if time.monotonic() > deadline or daemon.proc.poll() is not None:
            raise RuntimeError(f"the daemon took no snapshot:\n{daemon.stderr[-3000:]}")
        time.sleep(0.5)
    if "snapshots: took" not in took[0]:
        raise RuntimeError(f"the daemon took no snapshot: {took[0].strip()}")
    runs: dict[str, list[dict]] = {"imports": [], "snapshot": []}
    for i in range(settings.repeats):
        runs["imports"].append(
            _pod_start(settings, model, imports_args, logs / f"imports-{i}.log", "imports")
        )
        runs["snapshot"].append(
            _pod_start(settings, model, snapshot_args, logs / f"snapshot-{i}.log", "snapshot")
        )
    best = {kind: min(r["ready_s"] for r in found) for kind, found in runs.items()}
    images = sum(p.stat().st_size for p in store.rglob("*.img"))
    return {
        "imports_ready_s": best["imports"],
        "snapshot_ready_s": best["snapshot"],
        "imports_ready_s_runs": [r["ready_s"] for r in runs["imports"]],
        "snapshot_ready_s_runs": [r["ready_s"] for r in runs["snapshot"]],
        "restore_s_runs": [r["restore_s"] for r in runs["snapshot"]],
        "worker_ready_s_runs": {kind: [r["worker_ready_s"] for r in found] for kind, found in runs.items()},
        "snapshot_bytes": images,
        "took": took[0].strip().split("snapshots: ", 1)[1],
    }


MODEL_LOAD_PHASES = ("config", "model_meta", "weights")  # engine/startup.py: what from_pretrained also does


def model_load_s(phases: dict[str, float]) -> float:
    """An engine path's config, model and weights phases: the part from_pretrained is compared with."""
    return sum(phases.get(p, 0.0) for p in MODEL_LOAD_PHASES)


def run(settings: RestartSettings) -> dict:
    from keepwarm_runtime.weights.checkpoint import read_checkpoint

    if settings.tensor_parallel > 1:  # a group against one rank: its own report
        from bench._restart_group import run as run_group

        return run_group(settings)

    root = Path(settings.dir) if settings.dir else Path.home() / ".cache" / "keepwarm" / "bench"
    model = checkpoint_for(settings.size_gib, root)
    paths = Paths(model, tiny_checkpoint(root), settings)
    device = settings.device
    shards = read_checkpoint(model)
    out = {
        "size_bytes": sum(s.size for s in shards),
        "num_tensors": sum(len(s.tensors) for s in shards),
        "checkpoint_dtype": CHECKPOINT_DTYPE,
        "serving_dtype": settings.serving_dtype,
        "device": device,
        "tier": "gpu" if device.startswith("cuda") else "host",
        "prompt_tokens": PROMPT_LEN,
        "repeats": settings.repeats,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "loadavg_1m_start": round(os.getloadavg()[0], 2),
        "torch_threads": settings.threads,
        "engine_paths": "LLMEngine (engine.loader.load_model), first greedy token",
        **page_facts(),
    }
    cold = settings.drop_caches
    out["page_cache"] = "dropped before each cold path" if cold else "warm (not dropped)"
    hf = _best("hf", paths, cold=cold)
    disk = _best("disk", paths, cold=cold)
    serve: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="keepwarm-bench-") as tmp:
        if settings.serve:
            logs = Path(tmp) / "logs"
            if cold:
                serve["disk_cold"] = _serve_best(settings, model, logs, None, cold=True)
            serve["disk_warm"] = _serve_best(settings, model, logs, None, cold=False)
        on_gpu = device.startswith("cuda")
        store, criu = Path(tmp) / "snapshots", settings.criu
        snapshots = ["--snapshot-store", str(store), "--criu", criu] if settings.snapshot else []
        daemon = DaemonProcess(
            Path(tmp) / "wc",
            [model],
            *(["--device", device] if on_gpu else []),
            "--dtype",
            settings.serving_dtype,
            *snapshots,
            tier="gpu" if on_gpu else "host",
        ).wait_ready(timeout_s=900)
        try:
            warm = _best("warm", paths, Path(tmp) / "wc")
            if settings.serve:
                serve["cache"] = _serve_best(settings, model, logs, Path(tmp) / "wc", cold=False)
            if snapshots:
                logs = Path(tmp) / "logs"
                out["snapshot"] = snapshot_starts(
                    settings, model, logs, Path(tmp) / "wc", store, criu, daemon
                )
        finally:
            daemon.terminate(60)
    if warm["source"] != "cache":
        raise RuntimeError(f"warm path did not attach from the cache: {warm['reason']}")
    if not hf["token0"] == disk["token0"] == warm["token0"]:
        out["first_tokens_differ"] = [hf["token0"], disk["token0"], warm["token0"]]
    page_mode = [line for line in daemon.lines if "pages)" in line]
    out |= {
        "hf_from_pretrained_s": round(hf["seconds"], 4),
        "disk_s": round(disk["seconds"], 4),
        "warm_attach_s": round(warm["seconds"], 4),
        "ratio": round(hf["seconds"] / warm["seconds"], 2),
        "ratio_vs_disk": round(disk["seconds"] / warm["seconds"], 2),
        # The best any load path can do is a forward pass over weights already mapped in: the
        # ratio a free attach would reach on this machine.
        "forward_floor_s": round(floor := min(r["steady_forward_s"] for r in (hf, disk, warm)), 4),
        "ratio_ceiling": round(hf["seconds"] / floor, 2),
        "breakdown_s": {
            m: {"load": round(r["load_s"], 4), "forward": round(r["forward_s"], 4)}
            | ({"attach": round(r["attach_s"], 4)} if r["attach_s"] is not None else {})
            | ({"phases": {k: round(v, 4) for k, v in r["phases"].items()}} if r["phases"] else {})
            for m, r in (("hf", hf), ("disk", disk), ("warm", warm))
        },
        # Like for like: what from_pretrained does (config, the model, its weights) against the
        # engine's same phases; the tokenizer and the KV cache it also builds are in the phases above.
        "hf_load_s": round(hf["load_s"], 4),
        "disk_model_load_s": round(disk_load := model_load_s(disk["phases"]), 4),
        "disk_over_hf_load": round(disk_load / hf["load_s"], 2),
        "warm_model_load_s": round(warm_load := model_load_s(warm["phases"]), 4),
        "warm_model_load_over_attach_s": round(warm_load - warm["attach_s"], 4),
        "process_cold_s": round(disk["process_s"], 3),
        "process_hf_s": round(hf["process_s"], 3),
        "process_warm_s": round(warm["process_s"], 3),
        "daemon_ready_s": round(daemon.ready_s, 3),
        "loadavg_1m_end": round(os.getloadavg()[0], 2),
        "daemon_log": page_mode[-1].strip() if page_mode else None,
    }
    if serve:
        out["serve"] = serve
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.restart [flags]`; `keepwarm bench restart` calls ``report`` with its settings."""
    argv = sys.argv[1:] if argv is None else argv
    if "--child" in argv:
        return _child_main(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p, RestartSettings)
    try:
        settings = resolve(RestartSettings, p.parse_args(argv))
    except SettingError as exc:
        p.error(str(exc))
    return report(settings)


def report(settings: RestartSettings) -> int:
    if settings.drop_caches and (refusal := drop_caches_refusal(os.geteuid())):
        print(f"keepwarm bench restart: {refusal}", file=sys.stderr)
        return 2
    if settings.snapshot and (refusal := snapshot_refusal(os.geteuid(), settings.criu)):
        print(f"keepwarm bench restart: {refusal}", file=sys.stderr)
        return 2
    result = run(settings)
    print(json.dumps(result) if settings.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
