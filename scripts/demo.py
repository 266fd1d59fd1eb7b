#!/usr/bin/env python3
"""`make demo`: serve a model cold, restart it warm from the node weight cache, compare.

1. generate a 500M-parameter random-weight bf16 checkpoint (once; kept in out/demo/model), large
   enough that loading and converting weights shows next to start-up costs, small enough for a CPU,
2. start the cache daemon (`keepwarm cache serve`) holding that model in host shared memory,
3. start `keepwarm serve` cold (weights from disk), ask a chat question with the `openai` client,
4. stop it and start it warm (attached to the daemon, zero-copy), ask again,
5. print ready time, weight source and load time, and both answers.

Every child runs in its own process group and is stopped on exit, error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai

from keepwarm_runtime.server.launcher import ServerProcess, start_server

ROOT = Path(__file__).resolve().parent.parent
QUESTION = [{"role": "user", "content": "In one sentence: why keep model weights warm?"}]


def log(message: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {message}", flush=True)


def keepwarm(*args: str) -> list[str]:
    return [sys.executable, "-m", "keepwarm_runtime.cli", *args]


def ensure_model(model_dir: Path, params: str) -> None:
    if (model_dir / "config.json").exists():
        log(f"model: reusing {model_dir}")
        return
    log(f"model: generating a {params}-parameter Llama checkpoint in {model_dir}")
    command = keepwarm("make-model", str(model_dir), "--params", params, "--dtype", "bfloat16")
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)


def start_daemon(model_dir: Path, socket_dir: Path, dtype: str, log_path: Path, children: list) -> None:
    command = keepwarm(
        "cache",
        "serve",
        "--model",
        str(model_dir),
        "--socket-dir",
        str(socket_dir),
        "--tier",
        "host",
        "--dtype",
        dtype,
    )
    with open(log_path, "wb") as out:
        daemon = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    children.append(daemon)  # at once, so an interrupt while it loads still stops it
    deadline = time.monotonic() + 120
    while not (socket_dir / "host.sock").exists():
        if daemon.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(
                f"cache daemon did not come up; see {log_path}:\n{log_path.read_text()[-2000:]}"
            )
        time.sleep(0.1)


def serve_and_ask(model_dir: Path, log_path: Path, args: list[str], label: str, children: list) -> dict:
    log(f"{label}: starting keepwarm serve {' '.join(args)}")
    server = start_server(model_dir, log_path, args=["--served-model-name", "demo", *args])
    children.append(server)
    ready_s = server.wait("/ready", timeout=150)
    metrics = server.metrics()
    source = next((k.split('"')[1] for k in metrics if k.startswith("keepwarm_weight_load_seconds{")), "?")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="demo", max_retries=0, timeout=60)
    started = time.monotonic()
    reply = client.chat.completions.create(
        model="demo", messages=QUESTION, max_tokens=24, temperature=0, seed=0
    )
    answer_s = time.monotonic() - started
    server.stop()
    row = {
        "start": label,
        "ready_s": ready_s,
        "start_to_ready_s": metrics.get("keepwarm_process_start_to_ready_seconds", float("nan")),
        "source": source,
        "weights_s": metrics.get(f'keepwarm_weight_load_seconds{{source="{source}"}}', float("nan")),
        "answer_s": answer_s,
        "answer": reply.choices[0].message.content,
    }
    log(f"{label}: ready in {ready_s:.1f}s, weights from {source} in {row['weights_s']:.3f}s")
    return row


def print_table(rows: list[dict]) -> None:
    print()
    print(f"{'start':<6} {'ready (s)':>9} {'weights from':>12} {'weights (s)':>11} {'answer (s)':>10}")
    for r in rows:
        cells = f"{r['ready_s']:>9.1f} {r['source']:>12} {r['weights_s']:>11.3f} {r['answer_s']:>10.2f}"
        print(f"{r['start']:<6} {cells}")
    print()
    for r in rows:
        print(f"{r['start']} answer: {r['answer']!r}")
    same = len({r["answer"] for r in rows}) == 1
    print(f"answers identical (greedy, same weights): {'yes' if same else 'NO'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=ROOT / "out" / "demo" / "model")
    parser.add_argument("--params", default="500M", help="size of the generated model (default 500M)")
    parser.add_argument("--dtype", default="float32", help="serving dtype, shared by daemon and server")
    args = parser.parse_args()

    def interrupted(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    # Explicit for SIGINT too: a shell starts background jobs with SIGINT ignored.
    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, interrupted)
    children: list[ServerProcess | subprocess.Popen] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="keepwarm-demo-") as tmp:
        tmp_path = Path(tmp)
        socket_dir = tmp_path / "sockets"
        socket_dir.mkdir(mode=0o700)
        try:
            ensure_model(args.model_dir, args.params)
            log("cache daemon: starting keepwarm cache serve (host tier)")
            start_daemon(args.model_dir, socket_dir, args.dtype, tmp_path / "daemon.log", children)
            log("cache daemon: model resident")
            common = ["--dtype", args.dtype, "--kv-cache-memory-gib", "0.25"]
            rows = [
                serve_and_ask(args.model_dir, tmp_path / "cold.log", common, "cold", children),
                serve_and_ask(
                    args.model_dir,
                    tmp_path / "warm.log",
                    [*common, "--cache-socket-dir", str(socket_dir)],
                    "warm",
                    children,
                ),
            ]
            print_table(rows)
            log(f"done in {time.monotonic() - started:.0f}s")
            return 0 if rows[1]["source"] == "cache" else 1
        except KeyboardInterrupt:
            log("interrupted; stopping children")
            return 130
        except Exception as exc:
            log(f"failed: {exc}")
            for child in children:
                if isinstance(child, ServerProcess):
                    print(child.log_tail(20), file=sys.stderr)
            return 1
        finally:
            for child in reversed(children):
                _stop(child)


def _stop(child: ServerProcess | subprocess.Popen) -> None:
    if isinstance(child, ServerProcess):
        child.stop()
        return
    if child.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGTERM)
    try:
        child.wait(15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.wait(5)


if __name__ == "__main__":
    sys.exit(main())
