"""A real `keepwarm serve` started with a vLLM command line: `--lora-modules a=PATH b=PATH` (several
values after one flag, as vLLM documents it), vLLM's JSON entries among them, the flag repeated, and
vLLM's spellings of flags keepwarm implements; the official openai client gets each adapter's own
greedy tokens (PEFT's, on the same fp32 weights). A `vllm serve` flag keepwarm does not implement
stops the real command by name, with what to use instead, before anything loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from keepwarm_runtime.server.launcher import start_server
from keepwarm_runtime.server.settings import ServeSettings
from tests.lora_adapters import make_adapter, peft_greedy, served_greedy

NEW_TOKENS = 5
PROMPT = [5, 87, 301, 44, 1024, 9, 77]
TARGETS = (["q_proj", "v_proj"], ["gate_proj", "down_proj"], ["o_proj"], ["k_proj", "up_proj"])


@pytest.fixture(scope="module")
def vllm_server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("server-vllm-cli")
    names = ("sql", "chat", "json-one", "json-two")
    adapters = {
        name: make_adapter(tiny_llama, root / name, seed=i + 1, r=4, lora_alpha=8, target_modules=targets)
        for i, (name, targets) in enumerate(zip(names, TARGETS, strict=True))
    }
    expected = {n: peft_greedy(tiny_llama, adapters.get(n), [PROMPT], NEW_TOKENS)[0] for n in (None, *names)}
    entry = {"name": "json-one", "path": str(adapters["json-one"]), "base_model_name": "tiny"}
    args = ["--served-model-name", "tiny", "--dtype", "float", "--max-model-len", "256"]
    args += ["--num-gpu-blocks-override", "256", "--enforce-eager", "--disable-log-requests"]
    args += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--max-loras", "2"]
    # vLLM's form: several values after one flag, name=path and JSON mixed; then the flag again
    args += ["--lora-modules", f"sql={adapters['sql']}", f"chat={adapters['chat']}", json.dumps(entry)]
    args += ["--lora-modules", json.dumps({"name": "json-two", "path": str(adapters["json-two"])})]
    proc = start_server(tiny_llama, root / "serve.log", args=args)
    try:
        proc.wait("/ready", timeout=300)
        yield proc, expected
    finally:
        proc.stop()


def test_each_adapter_of_vllms_forms_answers_with_its_own_tokens(vllm_server) -> None:
    proc, expected = vllm_server
    client = openai.OpenAI(base_url=proc.url + "/v1", api_key="none", max_retries=0, timeout=120)
    served = {m.id: m.parent for m in client.models.list()}
    assert served == {"tiny": None, "sql": "tiny", "chat": "tiny", "json-one": "tiny", "json-two": "tiny"}
    for model in served:
        tokens = served_greedy(client, model, PROMPT, NEW_TOKENS)
        assert tokens == expected[None if model == "tiny" else model], model
    adapted = [tuple(expected[n]) for n in ("sql", "chat", "json-one", "json-two")]
    assert tuple(expected[None]) not in adapted  # every adapter changes the output, so each was applied


@pytest.mark.parametrize("flag", ["--pipeline-parallel-size", "--trust-remote-code"])
def test_a_vllm_flag_keepwarm_lacks_stops_the_real_command_by_name(flag: str, tmp_path: Path) -> None:
    answer = next(f.answer for f in ServeSettings.FOREIGN_FLAGS if f.flag == flag)
    argv = [sys.executable, "-m", "keepwarm_runtime.cli", "serve", str(tmp_path), flag, "2"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert f"{flag} is not implemented by keepwarm: {answer}" in done.stderr
