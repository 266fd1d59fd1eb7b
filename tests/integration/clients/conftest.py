"""One real `keepwarm serve` for the third-party client tests (lm-eval, openai-agents, instructor,
langchain-openai, guidellm, and the official `openai` client on prompt logprobs).

float32, so its numbers can be held to transformers' (and lm-eval's `hf` model's) on the same checkpoint;
the hermes tool-call parser, so `tool_choice: auto` works as agent SDKs use it; a small prompt-logprobs
bound, so a test can cross it. Every client runs offline: HF_HUB_OFFLINE and no telemetry.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from keepwarm_runtime.server.launcher import ServerProcess, start_server

MAX_MODEL_LEN = 512
MAX_PROMPT_LOGPROBS_LEN = 256
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "DO_NOT_TRACK": "1",
    "OPENAI_AGENTS_DISABLE_TRACING": "1",
    "GUIDELLM__DISABLE_TELEMETRY": "1",
}


@dataclass
class ClientServer:
    proc: ServerProcess
    model_dir: Path  # the checkpoint it serves (also the tokenizer clients load)
    model: str = "tiny"  # served model name

    @property
    def base_url(self) -> str:
        return self.proc.url + "/v1"


@pytest.fixture(scope="package", autouse=True)
def offline_clients():
    """Clients must never reach the network (tokenizer downloads, telemetry, tracing export). Package
    scope: the variables are restored when these tests end, so the agent tests that download from the
    loopback Hub later in the same session are not offline."""
    saved = {k: os.environ.get(k) for k in OFFLINE_ENV}
    os.environ.update(OFFLINE_ENV)
    os.environ.setdefault("OPENAI_API_KEY", "unused")
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def client_server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("clients-server-log") / "serve.log"
    args = ["--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN)]
    args += ["--num-kv-blocks", "512", "--tool-call-parser", "hermes"]
    args += ["--max-prompt-logprobs-len", str(MAX_PROMPT_LOGPROBS_LEN)]
    proc = start_server(tiny_llama, log, args=args)
    try:
        proc.wait("/ready", timeout=240)
        yield ClientServer(proc, tiny_llama)
    finally:
        assert proc.stop() is not None
