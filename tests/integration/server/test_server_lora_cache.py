"""A real `keepwarm serve` whose adapters come through a real node cache daemon, with the openai client.

The daemon holds the base and one adapter (`--adapter`); the server names the cache socket. The
`--lora-modules` adapter attaches from the cache, one loaded at runtime that the daemon lacks is read
from disk, and `keepwarm_lora_load_seconds{source}` counts each where it came from; both give PEFT's
greedy tokens, and each adapter's requests and generated tokens are counted under its name
(`keepwarm_lora_requests`, `keepwarm_lora_generation_tokens`; the base's are not).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import openai

from keepwarm_runtime.cache.launcher import DaemonProcess
from keepwarm_runtime.server.launcher import start_server
from tests.lora_adapters import make_adapter, peft_greedy, served_greedy

NEW_TOKENS = 6
PROMPT = [5, 87, 301, 44, 1024, 9, 77]


def test_adapters_from_cache_and_disk_match_peft_and_are_counted_by_source_and_name(
    tiny_llama: Path, tmp_path: Path
) -> None:
    cached = make_adapter(tiny_llama, tmp_path / "sql", seed=1, r=4, lora_alpha=8, target_modules=["q_proj"])
    late = make_adapter(tiny_llama, tmp_path / "late", seed=3, r=8, lora_alpha=4, target_modules=["o_proj"])
    expected = {
        n: peft_greedy(tiny_llama, p, [PROMPT], NEW_TOKENS)[0] for n, p in (("sql", cached), ("late", late))
    }
    socket_dir = tmp_path / "wc"
    daemon = DaemonProcess(
        socket_dir, [tiny_llama], "--dtype", "float32", "--adapter", str(cached)
    ).wait_ready()
    args = ["--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "64"]
    args += ["--lora-modules", f"sql={cached}", "--allow-runtime-lora-updating"]
    proc = start_server(
        tiny_llama, tmp_path / "serve.log", args=args, env={"KEEPWARM_CACHE_SOCKET_DIR": str(socket_dir)}
    )
    try:
        proc.wait("/ready", timeout=300)
        c = openai.OpenAI(base_url=proc.url + "/v1", api_key="none", max_retries=0, timeout=120)
        r = httpx.post(
            proc.url + "/v1/load_lora_adapter",
            json={"lora_name": "late", "lora_path": str(late)},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        for name in ("sql", "late", "sql", str(tiny_llama)):  # the last: the base model
            ids = served_greedy(c, name, PROMPT, NEW_TOKENS)
            assert ids == expected.get(name, ids), f"adapter {name}"
        samples = proc.metrics()
        assert samples['keepwarm_lora_requests_total{adapter="sql"}'] == 2
        assert samples['keepwarm_lora_requests_total{adapter="late"}'] == 1
        assert samples['keepwarm_lora_generation_tokens_total{adapter="sql"}'] == 2 * NEW_TOKENS
        assert samples['keepwarm_lora_generation_tokens_total{adapter="late"}'] == NEW_TOKENS
        assert samples["keepwarm_generation_tokens_total"] == 4 * NEW_TOKENS  # the base's too
        assert not [k for k in samples if k.startswith("keepwarm_lora_requests_total") and "tiny" in k]
        assert samples['keepwarm_lora_load_seconds_count{source="cache"}'] == 1
        assert samples['keepwarm_lora_load_seconds_count{source="disk"}'] == 1
        assert samples['keepwarm_weight_load_seconds{source="cache"}'] > 0
        log = proc.log_text()
        assert "LoRA adapter 'late': not from the node cache (absent)" in log, proc.log_tail()
    finally:
        proc.stop()
        daemon.kill()
