"""LoRA adapters through a real `keepwarm serve`, with the official openai client (vLLM's conventions).

One server: two adapters from `--lora-modules` (the name=path and the JSON form), one adapter slot
(so concurrent requests for two adapters queue), runtime load/unload enabled, and an API key. The
adapters' greedy tokens are PEFT's own (PeftModel.generate on the same fp32 weights).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import openai
import pytest

from keepwarm_runtime.server.launcher import start_server
from tests.lora_adapters import make_adapter, peft_greedy

KEY = "lora-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
NEW_TOKENS = 6
PROMPT = [5, 87, 301, 44, 1024, 9, 77]


@pytest.fixture(scope="module")
def lora_server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("server-lora")
    adapters = {
        "sql": make_adapter(
            tiny_llama, root / "sql", seed=1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]
        ),
        "json-form": make_adapter(
            tiny_llama, root / "json", seed=2, r=8, lora_alpha=16, target_modules=["gate_proj", "down_proj"]
        ),
        "late": make_adapter(tiny_llama, root / "late", seed=3, r=4, lora_alpha=4, target_modules=["o_proj"]),
        "too-big": make_adapter(
            tiny_llama, root / "big", seed=4, r=32, lora_alpha=8, target_modules=["q_proj"]
        ),
    }
    expected = {
        n: peft_greedy(tiny_llama, adapters.get(n), [PROMPT], NEW_TOKENS)[0]
        for n in (None, "sql", "json-form", "late")
    }
    json_form = json.dumps(
        {"name": "json-form", "path": str(adapters["json-form"]), "base_model_name": "tiny"}
    )
    args = [
        "--served-model-name",
        "tiny",
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--num-kv-blocks",
        "256",
    ]
    args += ["--lora-modules", f"sql={adapters['sql']}", "--lora-modules", json_form]
    args += ["--max-loras", "1", "--max-lora-rank", "16", "--allow-runtime-lora-updating"]
    proc = start_server(tiny_llama, root / "serve.log", args=args, env={"KEEPWARM_API_KEY": KEY})
    try:
        proc.wait("/ready", timeout=300)
        yield proc, adapters, expected
    finally:
        proc.stop()


def client(proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=proc.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def greedy(c: openai.OpenAI, model: str, max_tokens: int = NEW_TOKENS) -> openai.types.Completion:
    return c.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=max_tokens,
        temperature=0,
        logprobs=0,
        extra_body={"min_tokens": max_tokens, "return_tokens_as_token_ids": True},
    )


def token_ids(completion) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in completion.choices[0].logprobs.tokens]


def test_models_lists_adapters_with_their_parent(lora_server) -> None:
    proc, adapters, _ = lora_server
    models = {m.id: m for m in client(proc).models.list()}
    assert set(models) == {"tiny", "sql", "json-form"}
    assert models["sql"].parent == "tiny" and models["json-form"].parent == "tiny"
    assert models["sql"].root == str(adapters["sql"])
    assert client(proc).models.retrieve("sql").parent == "tiny"


def test_model_selects_the_adapter_and_matches_peft(lora_server) -> None:
    proc, _, expected = lora_server
    c = client(proc)
    for model, name in (("tiny", None), ("sql", "sql"), ("json-form", "json-form")):
        completion = greedy(c, model)
        assert token_ids(completion) == expected[name], model
        assert completion.model == model  # the response names the adapter, as vLLM's does
    assert expected["sql"] != expected[None] and expected["json-form"] != expected[None]
    chat = c.chat.completions.create(model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat.choices[0].finish_reason in ("length", "stop") and chat.model == "sql"


def test_unknown_model_is_404_naming_it(lora_server) -> None:
    proc, _, _ = lora_server
    with pytest.raises(openai.NotFoundError) as err:
        greedy(client(proc), "no-such-adapter")
    assert "no-such-adapter" in err.value.message
    assert err.value.code == "model_not_found"


def test_more_adapters_at_once_than_slots_queue(lora_server) -> None:
    proc, _, expected = lora_server
    c = openai.AsyncOpenAI(base_url=proc.url + "/v1", api_key=KEY, max_retries=0, timeout=120)

    async def one(model: str) -> list[int]:
        out = await c.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=NEW_TOKENS,
            temperature=0,
            logprobs=0,
            extra_body={"min_tokens": NEW_TOKENS, "return_tokens_as_token_ids": True},
        )
        return token_ids(out)

    async def run() -> list[list[int]]:
        return await asyncio.gather(*(one(m) for m in ["sql", "json-form", "tiny"] * 3))

    got = asyncio.run(run())
    assert got == [expected["sql"], expected["json-form"], expected[None]] * 3


def _post(proc, route: str, body: dict, headers: dict | None = AUTH) -> httpx.Response:
    return httpx.post(proc.url + route, json=body, headers=headers, timeout=120)


def test_load_and_unload_at_runtime(lora_server) -> None:
    proc, adapters, expected = lora_server
    c = client(proc)
    assert (
        _post(
            proc, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(adapters["late"])}, None
        ).status_code
        == 401
    )
    big = _post(
        proc, "/v1/load_lora_adapter", {"lora_name": "too-big", "lora_path": str(adapters["too-big"])}
    )
    assert big.status_code == 400 and "'too-big'" in big.json()["error"]["message"] and "rank 32" in big.text
    loaded = _post(proc, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(adapters["late"])})
    assert loaded.status_code == 200, loaded.text
    again = _post(proc, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(adapters["late"])})
    assert again.status_code == 400 and "already been loaded" in again.text
    assert "late" in {m.id for m in c.models.list()} and "too-big" not in {m.id for m in c.models.list()}
    assert token_ids(greedy(c, "late")) == expected["late"]
    assert token_ids(greedy(c, "sql")) == expected["sql"]  # the others are unaffected

    # In use: a long streamed request holds the adapter; unloading is refused until it is gone.
    stream = c.completions.create(
        model="late",
        prompt=PROMPT,
        max_tokens=200,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))
    deadline = time.monotonic() + 60  # the engine thread sets it after each step
    while 'running_lora_adapters="late"' not in (
        metrics := httpx.get(proc.url + "/metrics", timeout=30).text
    ):
        assert time.monotonic() < deadline, "keepwarm_lora_requests_info never showed the running adapter"
        time.sleep(0.1)
    assert 'max_lora="1"' in metrics and "keepwarm_lora_requests_info{" in metrics
    busy = _post(proc, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert busy.status_code == 409 and "'late'" in busy.json()["error"]["message"], busy.text
    stream.close()
    deadline = time.monotonic() + 60
    while (done := _post(proc, "/v1/unload_lora_adapter", {"lora_name": "late"})).status_code == 409:
        assert time.monotonic() < deadline, "the aborted request never released the adapter"
        time.sleep(0.2)
    assert done.status_code == 200, done.text
    with pytest.raises(openai.NotFoundError):
        greedy(c, "late")
    gone = _post(proc, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert gone.status_code == 404 and "'late'" in gone.text
    assert token_ids(greedy(c, "json-form")) == expected["json-form"]


def _feed_fifo(path: Path, text: str, until) -> None:
    """Write ``text`` to the FIFO once its reader has it open, having first put a regular file with
    that text in its place (the reader holds the FIFO by descriptor; later checks see a plain file).
    Gives up if ``until`` (a future) ends first, so a load that never reads it cannot hang the test."""
    import errno
    import os

    deadline = time.monotonic() + 120
    while not until.done() and time.monotonic() < deadline:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # ENXIO: no reader yet
                raise
            time.sleep(0.05)
            continue
        regular = path.with_suffix(".regular")
        regular.write_text(text)
        os.replace(regular, path)
        with os.fdopen(fd, "w") as fifo:
            fifo.write(text)
        return


def test_an_adapter_read_that_stalls_does_not_pause_serving(lora_server, tmp_path: Path) -> None:
    """The adapter's config is a FIFO nobody writes yet: its read blocks (as a slow volume would).
    The base model keeps answering meanwhile; once the config arrives the load completes and the
    adapter serves PEFT's tokens."""
    import concurrent.futures
    import os
    import shutil

    proc, adapters, expected = lora_server
    slow = tmp_path / "slow"
    shutil.copytree(adapters["late"], slow)
    config = (slow / "adapter_config.json").read_text()
    (slow / "adapter_config.json").unlink()
    os.mkfifo(slow / "adapter_config.json")
    body = {"lora_name": "slow", "lora_path": str(slow)}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        load = pool.submit(_post, proc, "/v1/load_lora_adapter", body)
        try:
            assert token_ids(greedy(client(proc), "tiny")) == expected[None]
            assert not load.done(), load.result().text  # still waiting for its config
        finally:
            _feed_fifo(slow / "adapter_config.json", config, until=load)  # even on failure: unblocks it
        assert load.result().status_code == 200, load.result().text
    c = client(proc)
    assert token_ids(greedy(c, "slow")) == expected["late"]
    assert _post(proc, "/v1/unload_lora_adapter", {"lora_name": "slow"}).status_code == 200


def test_a_bad_lora_module_fails_the_start_naming_it(tiny_llama: Path, tmp_path: Path) -> None:
    proc = start_server(
        tiny_llama, tmp_path / "serve.log", args=["--lora-modules", f"broken={tmp_path / 'absent'}"]
    )
    try:
        code = proc.proc.wait(timeout=300)
    finally:
        proc.stop()
    assert code != 0
    assert "adapter 'broken'" in proc.log_text() and "is not a directory" in proc.log_text()
