"""`keepwarm serve --dtype auto` resolves the dtype before the engine loads, logs why, and serves."""

from __future__ import annotations

import json
from pathlib import Path

import openai

from keepwarm_runtime.engine import auto_dtype
from keepwarm_runtime.server.launcher import start_server


def test_dtype_auto_serves_the_dtype_the_decision_names(tiny_llama: Path, tmp_path: Path) -> None:
    config = json.loads((tiny_llama / "config.json").read_text())
    flags = (
        auto_dtype.parse_cpu_flags(auto_dtype.CPUINFO.read_text())
        if auto_dtype.CPUINFO.exists()
        else frozenset()
    )
    expected, why = auto_dtype.choose_dtype(auto_dtype.config_dtype(config), flags, "cpu")

    proc = start_server(
        tiny_llama, tmp_path / "serve.log", args=["--dtype", "auto", "--max-model-len", "256"]
    )
    try:
        proc.wait("/ready", timeout=240)
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0)
        reply = client.chat.completions.create(
            model=tiny_llama.name, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert reply.usage.completion_tokens >= 1
    finally:
        proc.stop()
    log = proc.log_text()
    assert f"--dtype auto: {expected} ({why})" in log and f"'dtype': '{expected}'" in log, log[-2000:]
