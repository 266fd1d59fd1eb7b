"""`--lora-modules-file` through a real `keepwarm serve`: the served adapters follow the file while the
server runs, as the operator's ConfigMap updates them (no restart, nothing in use freed).

The file is replaced as the kubelet replaces a ConfigMap's file: new content written beside it, then
renamed over it. Greedy tokens are PEFT's own (PeftModel.generate on the same fp32 weights).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import openai
import pytest

from keepwarm_api.serveflags import lora_modules_file
from keepwarm_runtime.server.launcher import ServerProcess, start_server
from tests.lora_adapters import make_adapter, peft_greedy, served_greedy

NEW_TOKENS = 6
PROMPT = [5, 87, 301, 44, 1024, 9, 77]
LONG = 3000  # tokens of the request an unloading adapter must outlive (seconds of steps, not one poll)
WAIT_S = 120  # the file is read every second; this bounds a very busy box


def write_list(path: Path, adapters: dict[str, Path | str]) -> None:
    """Replace the list atomically, as the kubelet swaps a ConfigMap volume's files."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(lora_modules_file({name: str(p) for name, p in adapters.items()}))
    os.replace(tmp, path)


@pytest.fixture(scope="module")
def file_server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("server-lora-file")
    adapters = {
        "sql": make_adapter(
            tiny_llama, root / "sql", seed=1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]
        ),
        "late": make_adapter(tiny_llama, root / "late", seed=3, r=4, lora_alpha=4, target_modules=["o_proj"]),
        "flag": make_adapter(tiny_llama, root / "flag", seed=5, r=4, lora_alpha=4, target_modules=["k_proj"]),
        "too-big": make_adapter(
            tiny_llama, root / "big", seed=4, r=32, lora_alpha=8, target_modules=["q_proj"]
        ),
    }
    expected = {
        n: peft_greedy(tiny_llama, adapters.get(n), [PROMPT], NEW_TOKENS)[0] for n in (None, "sql", "late")
    }
    listing = root / "adapters.json"
    write_list(listing, {"sql": adapters["sql"]})
    args = ["--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "4096"]
    args += ["--lora-modules-file", str(listing), "--lora-modules", f"flag={adapters['flag']}"]
    args += ["--max-loras", "2", "--max-lora-rank", "16"]
    proc = start_server(tiny_llama, root / "serve.log", args=args)
    try:
        proc.wait("/ready", timeout=300)
        yield proc, listing, adapters, expected
    finally:
        proc.stop()


def client(proc: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=proc.url + "/v1", api_key="none", max_retries=0, timeout=120)


def served(proc: ServerProcess) -> dict[str, str]:
    """Adapter name -> its directory, as /v1/models lists them."""
    return {m.id: m.root for m in client(proc).models.list() if m.id != "tiny"}


def greedy_ids(proc: ServerProcess, model: str) -> list[int]:
    return served_greedy(client(proc), model, PROMPT, NEW_TOKENS)


def wait_served(proc: ServerProcess, want: dict[str, str]) -> None:
    deadline = time.monotonic() + WAIT_S
    while (now := served(proc)) != want:
        assert time.monotonic() < deadline, f"served {now}, want {want}"
        time.sleep(0.1)


def test_the_file_s_adapters_serve_from_ready(file_server) -> None:
    proc, _, adapters, expected = file_server
    assert served(proc) == {"sql": str(adapters["sql"]), "flag": str(adapters["flag"])}  # no wait: at /ready
    assert greedy_ids(proc, "sql") == expected["sql"] != expected[None]
    assert greedy_ids(proc, "tiny") == expected[None]


def test_a_changed_list_loads_and_unloads_without_a_restart(file_server) -> None:
    proc, listing, adapters, expected = file_server
    write_list(listing, {"late": adapters["late"]})
    wait_served(proc, {"late": str(adapters["late"]), "flag": str(adapters["flag"])})
    assert greedy_ids(proc, "late") == expected["late"]
    with pytest.raises(openai.NotFoundError) as err:
        greedy_ids(proc, "sql")
    assert "sql" in err.value.message
    write_list(listing, {"sql": adapters["sql"], "late": adapters["late"]})
    wait_served(
        proc, {"sql": str(adapters["sql"]), "late": str(adapters["late"]), "flag": str(adapters["flag"])}
    )
    assert greedy_ids(proc, "sql") == expected["sql"]


def test_a_removed_adapter_in_use_finishes_its_requests_first(file_server) -> None:
    """Removed from the file mid-request: no new request may name it at once, the running one ends
    whole, and only then is it unloaded (seen when the same name comes back with other weights)."""
    proc, listing, adapters, expected = file_server
    write_list(listing, {"sql": adapters["sql"], "late": adapters["late"]})
    wait_served(
        proc, {"sql": str(adapters["sql"]), "late": str(adapters["late"]), "flag": str(adapters["flag"])}
    )
    stream = client(proc).completions.create(
        model="late",
        prompt=PROMPT,
        max_tokens=LONG,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"min_tokens": LONG},
    )
    chunks = iter(stream)
    next(chunks)  # generating
    write_list(listing, {"sql": adapters["sql"], "late": adapters["sql"]})  # same name, other weights
    wait_served(proc, {"sql": str(adapters["sql"]), "flag": str(adapters["flag"])})  # out of `model`
    assert debug_stats(proc)["num_running"] == 1  # ... while its request still runs
    usage = [c.usage for c in chunks if c.usage is not None]
    assert usage[-1].completion_tokens == LONG  # it ran to the end on its weights
    # Unloaded once idle, then loaded from its new directory: the same name now gives sql's tokens.
    wait_served(
        proc, {"sql": str(adapters["sql"]), "late": str(adapters["sql"]), "flag": str(adapters["flag"])}
    )
    assert greedy_ids(proc, "late") == expected["sql"]
    assert "LoRA adapter 'late' unloaded" in proc.log_text()


def test_bad_entries_are_refused_by_name_and_the_rest_serve(file_server) -> None:
    proc, listing, adapters, expected = file_server
    write_list(
        listing,
        {
            "sql": adapters["sql"],
            "too-big": adapters["too-big"],
            "flag": adapters["late"],
            "tiny": adapters["late"],
        },
    )
    deadline = time.monotonic() + WAIT_S
    while set(refused := metric_series(proc, "keepwarm_lora_adapter_refused")) != {"too-big", "flag", "tiny"}:
        assert time.monotonic() < deadline, refused
        time.sleep(0.1)
    assert served(proc) == {
        "sql": str(adapters["sql"]),
        "flag": str(adapters["flag"]),
    }  # flag: still the flag's
    log = proc.log_text()
    assert "LoRA adapter 'too-big' not served" in log and "rank" in log
    assert "LoRA adapter 'flag' not served: --lora-modules or /v1/load_lora_adapter already serves it" in log
    assert "LoRA adapter 'tiny' not served: it is the served model's name" in log
    assert greedy_ids(proc, "sql") == expected["sql"]
    write_list(listing, {"sql": adapters["sql"]})
    deadline = time.monotonic() + WAIT_S
    while metric_series(proc, "keepwarm_lora_adapter_refused"):
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_an_unparsable_file_keeps_the_served_adapters(file_server) -> None:
    proc, listing, adapters, _ = file_server
    write_list(listing, {"sql": adapters["sql"]})
    wait_served(proc, {"sql": str(adapters["sql"]), "flag": str(adapters["flag"])})
    tmp = listing.with_suffix(".tmp")
    tmp.write_text(json.dumps([{"name": "sql"}]))  # no path
    os.replace(tmp, listing)
    deadline = time.monotonic() + WAIT_S
    while "adapters.json entry 0: JSON form needs string name and path" not in proc.log_text():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert served(proc) == {"sql": str(adapters["sql"]), "flag": str(adapters["flag"])}
    write_list(listing, {"sql": adapters["sql"]})


def debug_stats(proc: ServerProcess) -> dict[str, float]:
    import httpx

    return httpx.get(proc.url + "/debug/stats", timeout=30).json()


def metric_series(proc: ServerProcess, name: str) -> dict[str, float]:
    """adapter label -> value of the metric's series."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(proc.url + "/metrics", timeout=30).text
    return {
        s.labels["adapter"]: s.value
        for family in text_string_to_metric_families(text)
        if family.name == name
        for s in family.samples
    }


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "No such file"),
        ("{}", "expected a JSON list"),
        ('[{"name": "a", "path": "/x"}, {"name": "a", "path": "/y"}]', "'a' is listed twice"),
    ],
)
def test_a_missing_or_bad_file_fails_the_start(tiny_llama: Path, tmp_path: Path, content, message) -> None:
    listing = tmp_path / "adapters.json"
    if content is not None:
        listing.write_text(content)
    proc = start_server(tiny_llama, tmp_path / "serve.log", args=["--lora-modules-file", str(listing)])
    try:
        code = proc.proc.wait(timeout=300)
    finally:
        proc.stop()
    assert code == 2
    assert "--lora-modules-file" in proc.log_text() and message in proc.log_text()
