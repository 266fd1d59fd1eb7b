"""guidellm (a load generator for OpenAI-compatible servers) runs a short load against `keepwarm serve`
over chat completions and completions: every request succeeds, streamed, with the asked output length.

Offline: the tokenizer is the served checkpoint's directory (no hub), synthetic prompts, and
GUIDELLM__DISABLE_TELEMETRY / HF_HUB_OFFLINE in the environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.clients.conftest import OFFLINE_ENV

pytestmark = pytest.mark.slow
REQUESTS = 6
OUTPUT_TOKENS = 8


@pytest.mark.parametrize(
    ("request_format", "profile"),
    [("/v1/chat/completions", "kind=concurrent,streams=2"), ("/v1/completions", "kind=synchronous")],
)
def test_a_short_load_run_succeeds(client_server, tmp_path: Path, request_format, profile) -> None:
    out = tmp_path / "benchmarks.json"
    backend = f"kind=openai_http,target={client_server.proc.url},model={client_server.model}"
    command = [
        *(sys.executable, "-m", "guidellm", "run"),
        *("--backend", f"{backend},request_format={request_format}"),
        *("--profile", profile),
        *("--constraint", f"kind=max_requests,count={REQUESTS}"),
        *("--tokenizer", f"kind=huggingface_auto,model={client_server.model_dir}"),
        *("--data", f"kind=synthetic_text,prompt_tokens=16,output_tokens={OUTPUT_TOKENS}"),
        *("--output", f"kind=json,path={out}"),
        "--disable-console-interactive",
    ]
    done = subprocess.run(
        command, cwd=tmp_path, env=os.environ | OFFLINE_ENV, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (benchmark,) = json.loads(out.read_text())["benchmarks"]
    totals = benchmark["metrics"]["request_totals"]
    assert totals == {"successful": REQUESTS, "errored": 0, "incomplete": 0, "total": REQUESTS}
    output_tokens = benchmark["metrics"]["output_token_count"]["successful"]
    assert output_tokens["median"] == OUTPUT_TOKENS and output_tokens["count"] == REQUESTS
