"""LoRA adapters through the node cache: real `keepwarm cache serve --adapter` processes.

An engine with a cache socket attaches each adapter the daemon holds zero-copy (read-only views of
its arena) and reads any other from disk; greedy fp32 tokens equal PEFT's either way, alone and mixed
in one batch with the base. The daemon lists adapters (`ls`, `stats`, /metrics) and applies none of
a model's conversions to them. An adapter rewritten on disk is never served stale, and a daemon that
is absent or restarting costs a disk read, named in the log, never a failed load.
"""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from keepwarm_runtime import LLM
from keepwarm_runtime.cache.adapters import WEIGHTS_FILE
from keepwarm_runtime.cache.client import attach_adapter, connect, request
from keepwarm_runtime.cache.launcher import DaemonProcess
from keepwarm_runtime.engine.llm import LoRARequest
from tests.integration.engine.test_lora import ADAPTERS, NEW_TOKENS, PARAMS, prompts_for
from tests.lora_adapters import lora_engine, make_adapter, peft_greedy

LOG = "keepwarm_runtime.engine.lora.adapter"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Setup:
    """A tiny fp32 Llama, adapters attn and mlp held by a daemon (with the base), kv on disk only."""

    def __init__(self, root: Path, model_dir: Path) -> None:
        self.root, self.model_dir = root, model_dir
        self.adapters = {
            n: make_adapter(model_dir, root / n, seed=i, **ADAPTERS[n])
            for i, n in enumerate(("attn", "mlp", "kv"))
        }
        self.prompts = prompts_for(2048, 3, seed=7)
        self.expected = {
            n: peft_greedy(model_dir, self.adapters.get(n), self.prompts, NEW_TOKENS)
            for n in (None, "attn", "mlp", "kv")
        }
        self.socket_dir = root / "wc"
        self.metrics_port = free_port()
        cached = [a for n in ("attn", "mlp") for a in ("--adapter", str(self.adapters[n]))]
        self.daemon = DaemonProcess(
            self.socket_dir,
            [model_dir],
            "--dtype",
            "float32",
            "--metrics-port",
            str(self.metrics_port),
            *cached,
        ).wait_ready()


@pytest.fixture(scope="module")
def setup(make_tiny, tmp_path_factory: pytest.TempPathFactory):
    made = Setup(tmp_path_factory.mktemp("lora-cache"), make_tiny("llama"))
    yield made
    made.daemon.kill()


def engine(model_dir: Path, socket_dir: Path | None, max_loras: int = 3) -> LLM:
    return lora_engine(model_dir, max_loras, socket_dir=socket_dir)


def arena_regions() -> list[tuple[int, int]]:
    """Read-only shared mappings of keepwarm arenas in this process."""
    lines = Path("/proc/self/maps").read_text().splitlines()
    return [
        tuple(int(x, 16) for x in line.split()[0].split("-"))  # type: ignore[misc]
        for line in lines
        if "keepwarm:" in line and "r--s" in line
    ]


def assert_in_arena(weights) -> None:
    regions = arena_regions()
    for module, (a, b) in weights.modules.items():
        for t in (a, b):
            assert any(lo <= t.data_ptr() < hi for lo, hi in regions), f"{module} is not in a read-only arena"


def tokens(llm: LLM, prompts, lora) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, lora_request=lora)
    return [o.outputs[0].token_ids for o in outs]


def test_cached_adapters_match_peft_alone_and_mixed_with_base_and_disk_adapter(setup: Setup) -> None:
    llm = engine(setup.model_dir, setup.socket_dir)
    assert llm.engine.load_info.source == "cache"
    lora = {None: None} | {
        n: LoRARequest(n, i + 1, str(p)) for i, (n, p) in enumerate(setup.adapters.items())
    }
    for name in ("attn", "mlp", "kv"):
        assert tokens(llm, setup.prompts, lora[name]) == setup.expected[name], f"adapter {name} alone"
    registered = llm.engine.lora.adapters
    assert (registered["attn"].source, registered["attn"].reason) == ("cache", None)
    assert (registered["mlp"].source, registered["mlp"].reason) == ("cache", None)
    assert (registered["kv"].source, registered["kv"].reason) == ("disk", "absent")
    assert_in_arena(registered["attn"])
    assert_in_arena(registered["mlp"])

    order = [(n, i) for i in range(len(setup.prompts)) for n in (None, "attn", "mlp", "kv")]
    got = tokens(llm, [setup.prompts[i] for _, i in order], [lora[n] for n, _ in order])
    wrong = [(n, i) for (n, i), t in zip(order, got, strict=True) if t != setup.expected[n][i]]
    assert not wrong, f"mixed batch (cache, disk and base) differs from PEFT for {wrong}"


def test_daemon_lists_adapters_in_ls_stats_and_metrics(setup: Setup) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    ls = subprocess.run(
        [sys.executable, "-m", "keepwarm_runtime.cli", "cache", "ls", "--socket", str(setup.daemon.socket)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    kinds = {line.split("\t")[0]: line.split("\t")[1] for line in ls.splitlines()}
    assert kinds == {"attn": "adapter", "mlp": "adapter", setup.model_dir.name: "model"}, ls
    with connect(setup.daemon.socket, timeout_s=10.0) as sock:
        stats, _ = request(sock, {"cmd": "stats"})
    assert stats["models"]["attn"]["kind"] == "adapter"
    assert stats["resident_bytes"] == sum(m["bytes"] for m in stats["models"].values())

    body = (
        urllib.request.urlopen(f"http://127.0.0.1:{setup.metrics_port}/metrics", timeout=30).read().decode()
    )
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }
    assert samples[("keepwarm_cache_resident_adapters", ())] == 2
    for name in ("attn", "mlp"):
        assert samples[("keepwarm_cache_resident_bytes", (("model", name), ("tier", "host")))] > 0


def test_no_model_conversion_applies_to_adapters(setup: Setup, tmp_path: Path) -> None:
    """A daemon that quantizes models to FP8 and converts experts serves adapters as stored."""
    adapter = setup.adapters["attn"]
    daemon = DaemonProcess(
        tmp_path / "wc",
        [],
        "--dtype",
        "float32",
        "--quantization",
        "fp8",
        "--expert-layout",
        "flashinfer_cutlass",
        "--adapter",
        str(adapter),
    ).wait_ready()
    try:
        hit = attach_adapter(adapter, tmp_path / "wc", dtype=torch.float32, fallback=False)
        disk = attach_adapter(adapter, None, dtype=torch.float32)
    finally:
        daemon.kill()
    assert (hit.source, disk.source) == ("cache", "disk")
    assert hit.tensors.keys() == disk.tensors.keys()
    for name, t in disk.tensors.items():
        assert hit.tensors[name].dtype == torch.float32 and torch.equal(hit.tensors[name], t), name


def wait_for(condition, timeout_s: float = 120.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_adapter_rewritten_on_disk_is_never_served_stale(setup: Setup, tmp_path: Path) -> None:
    adapter = tmp_path / "live"
    shutil.copytree(setup.adapters["attn"], adapter)
    other = make_adapter(setup.model_dir, tmp_path / "other", seed=42, **ADAPTERS["attn"])
    socket_dir = tmp_path / "wc"
    daemon = DaemonProcess(socket_dir, [], "--dtype", "float32", "--adapter", str(adapter)).wait_ready()
    try:
        llm = engine(setup.model_dir, socket_dir)
        assert tokens(llm, setup.prompts, LoRARequest("v1", 1, str(adapter))) == setup.expected["attn"]
        assert llm.engine.lora.adapters["v1"].source == "cache"

        shutil.copyfile(other / WEIGHTS_FILE, adapter / WEIGHTS_FILE)  # rewritten in place
        expected = peft_greedy(setup.model_dir, adapter, setup.prompts, NEW_TOKENS)
        assert expected != setup.expected["attn"]
        assert tokens(llm, setup.prompts, LoRARequest("v2", 2, str(adapter))) == expected
        v2 = llm.engine.lora.adapters["v2"]
        assert v2.source == "disk" and v2.reason is not None and v2.reason.startswith("mismatch"), v2.reason

        # The daemon reloads it in the background; then the new bytes come from the cache.
        def cached_again():
            res = attach_adapter(adapter, socket_dir, dtype=torch.float32)
            return res if res.source == "cache" else None

        fresh = wait_for(cached_again, what="the daemon to reload the rewritten adapter")
        disk = attach_adapter(adapter, None, dtype=torch.float32)
        assert all(torch.equal(fresh.tensors[n], t) for n, t in disk.tensors.items())
        assert tokens(llm, setup.prompts, LoRARequest("v3", 3, str(adapter))) == expected
        assert llm.engine.lora.adapters["v3"].source == "cache"
    finally:
        daemon.kill()


def test_daemon_absent_or_restarting_falls_back_to_disk_by_name(
    setup: Setup, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    adapter = setup.adapters["mlp"]
    socket_dir = tmp_path / "wc"
    llm = engine(setup.model_dir, socket_dir)  # no daemon yet: the base comes from disk too
    with caplog.at_level(logging.WARNING, logger=LOG):
        assert (
            tokens(llm, setup.prompts, LoRARequest("before-start", 1, str(adapter))) == setup.expected["mlp"]
        )
    weights = llm.engine.lora.adapters["before-start"]
    assert weights.source == "disk" and weights.reason.startswith("unavailable"), weights.reason
    assert any("'before-start'" in r.getMessage() and "from disk" in r.getMessage() for r in caplog.records)

    daemon = DaemonProcess(socket_dir, [], "--dtype", "float32", "--adapter", str(adapter)).wait_ready()
    try:
        assert tokens(llm, setup.prompts, LoRARequest("served", 2, str(adapter))) == setup.expected["mlp"]
        assert llm.engine.lora.adapters["served"].source == "cache"
    finally:
        daemon.kill()  # SIGKILL: its socket file stays behind, refusing connections (a restart)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOG):
        assert tokens(llm, setup.prompts, LoRARequest("after-kill", 3, str(adapter))) == setup.expected["mlp"]
    weights = llm.engine.lora.adapters["after-kill"]
    assert weights.source == "disk" and weights.reason.startswith("unavailable"), weights.reason
    assert any("'after-kill'" in r.getMessage() for r in caplog.records)


def test_a_successor_daemon_serves_the_adapter_it_took_over(setup: Setup, tmp_path: Path) -> None:
    """A restart by hand-off keeps the adapter resident, still an adapter (adopt.py keys it as one)."""
    adapter = setup.adapters["kv"]
    socket_dir = tmp_path / "wc"
    first = DaemonProcess(socket_dir, [], "--dtype", "float32", "--adapter", str(adapter)).wait_ready()
    second = DaemonProcess(socket_dir, [], "--dtype", "float32")  # no --adapter: only a take-over has it
    try:
        second.wait_ready()
        assert first.wait_exit(120) == 0, first.stderr
        with connect(second.socket, timeout_s=10.0) as sock:
            stats, _ = request(sock, {"cmd": "stats"})
        assert stats["models"]["kv"]["kind"] == "adapter", second.stderr
        hit = attach_adapter(adapter, socket_dir, dtype=torch.float32, fallback=False)
        disk = attach_adapter(adapter, None, dtype=torch.float32)
        assert hit.source == "cache"
        assert all(torch.equal(hit.tensors[n], t) for n, t in disk.tensors.items())
    finally:
        first.kill()
        second.kill()
