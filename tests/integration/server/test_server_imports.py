"""A plain Llama checkpoint is served without the optional stacks: no audio decoders, no grammar
engines, no LoRA library, no Kubernetes client, in the serving process (`keepwarm serve
--no-supervise`, after real requests) nor in the supervising parent's preload (what every worker
starts with). Each is seconds of start-up on a small CPU, paid on every restart when imported.

Both run in fresh subprocesses and report their ``sys.modules``: the serve through keepwarm's own
command-line entry point (in a thread, so the process can report once it has answered)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from keepwarm_runtime.server.launcher import free_port

# Imported only when a request or a checkpoint needs them (soundfile is not here: transformers'
# processing_utils, which every modelling module imports, imports it when it is installed).
OPTIONAL = (
    "torchcodec",  # audio decoders: only a speech checkpoint or an audio request
    "av",
    "xgrammar",  # structured outputs: only a constrained request
    "llguidance",
    "tiktoken",
    "keepwarm_runtime.engine.structured",
    "peft",  # LoRA adapters are read by keepwarm itself
    "kubernetes",  # the node agent's, never the server's
    "kopf",
    # The node agent's loop, state and downloads (agent/settings.py is two constants with no imports,
    # the defaults of `keepwarm cache serve`'s agent flags, which `keepwarm --help` lists).
    "keepwarm_runtime.agent.kubernetes",
    "keepwarm_runtime.agent.state",
    "keepwarm_runtime.agent.download",
)
NEEDED = (
    "torch",
    "transformers.models.llama.modeling_llama",
    "uvicorn",
    "keepwarm_runtime.engine.llm_engine",
)

SERVE = """
import json, os, sys, threading, time, urllib.request
model, port, out = sys.argv[1:4]
from keepwarm_runtime.cli import main
args = ["serve", model, "--host", "127.0.0.1", "--port", port, "--no-supervise", "--served-model-name", "m"]
threading.Thread(target=main, args=(args,), daemon=True).start()
url = f"http://127.0.0.1:{port}"
for _ in range(1200):
    try:
        urllib.request.urlopen(url + "/ready", timeout=1)
        break
    except OSError:
        time.sleep(0.1)
def post(path, body):
    headers = {"content-type": "application/json"}
    request = urllib.request.Request(url + path, json.dumps(body).encode(), headers)
    return urllib.request.urlopen(request, timeout=120).read()
post("/v1/completions", {"model": "m", "prompt": "hello", "max_tokens": 2})
messages = [{"role": "user", "content": "hi"}]
post("/v1/chat/completions", {"model": "m", "messages": messages, "max_tokens": 2, "stream": True})
json.dump(sorted(sys.modules), open(out, "w"))
os._exit(0)
"""

PRELOAD = """
import json, sys
from keepwarm_runtime.model_kind import detect_kind
from keepwarm_runtime.server.preload import preload
preload(sys.argv[1], detect_kind(sys.argv[1]))
json.dump(sorted(sys.modules), open(sys.argv[2], "w"))
"""


def _modules(script: str, *args: str, out: Path) -> set[str]:
    done = subprocess.run([sys.executable, "-c", script, *args, str(out)], capture_output=True, timeout=600)
    assert done.returncode == 0 and out.exists(), done.stderr.decode(errors="replace")[-3000:]
    return set(json.loads(out.read_text()))


def _imported(modules: set[str], name: str) -> bool:
    return name in modules or any(m.startswith(name + ".") for m in modules)


@pytest.mark.parametrize("process", ["serve", "preload"])
def test_a_plain_llama_checkpoint_imports_no_optional_stack(
    tiny_llama: Path, tmp_path: Path, process: str
) -> None:
    if process == "serve":
        modules = _modules(SERVE, str(tiny_llama), str(free_port()), out=tmp_path / "modules.json")
    else:
        modules = _modules(PRELOAD, str(tiny_llama), out=tmp_path / "modules.json")
    assert [name for name in NEEDED if name not in modules] == []  # the report is of a real serving path
    assert [name for name in OPTIONAL if _imported(modules, name)] == []
