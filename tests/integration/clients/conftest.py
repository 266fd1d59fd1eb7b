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


@pytest.fixture(scope="module", autouse=True)
def offline_clients():
    """Clients must never reach the network (tokenizer downloads, telemetry, tracing export).

    Module scope: a "package" fixture here would belong to `tests` (the nearest directory with an
    __init__.py) and so last the whole session, leaving the agent's loopback-Hub downloads offline.
    huggingface_hub reads HF_HUB_OFFLINE once, at import, into a constant every later call consults,
    so the constant is set and restored along with the variables."""
    from huggingface_hub import constants

    with pytest.MonkeyPatch.context() as patch:
        for key, value in OFFLINE_ENV.items():
            patch.setenv(key, value)
        patch.setenv("OPENAI_API_KEY", os.environ.get("OPENAI_API_KEY", "unused"))
        patch.setattr(constants, "HF_HUB_OFFLINE", True)
        yield


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
