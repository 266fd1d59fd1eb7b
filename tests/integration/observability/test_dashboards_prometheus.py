"""The shipped dashboards against a real Prometheus scraping real keepwarm processes.

Debian's Prometheus on loopback scrapes, every second: a `keepwarm cache serve` node agent (three
models under a budget, so one is evicted), a `keepwarm serve` restarted once cold (its dtype does not
match the cache, so weights come from disk) and once warm (attached from the cache) while clients
send traffic, and a `keepwarm-operator` on the real control plane that first fails to apply (a
ResourceQuota forbids DaemonSets) and then recovers. Every panel's every query is then evaluated over
the run through the HTTP API: any error or empty result fails. The panels are drawn to PNGs
(KEEPWARM_DOCS_PNG=1 writes them to docs/ as well).
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from keepwarm_runtime.cache.launcher import DaemonProcess
from keepwarm_runtime.server.launcher import free_port, start_server
from keepwarm_runtime.weights.arena import plan_layout
from keepwarm_runtime.weights.checkpoint import read_checkpoint
from keepwarm_testing.operator import (
    NAMESPACE,
    OperatorProcess,
    install_chart_rbac,
    install_crds,
)
from tests.integration.observability.prometheus import (
    SCRAPE_INTERVAL_S,
    Prometheus,
    PrometheusMissing,
    Series,
    grafana_to_promql,
)
from tests.integration.observability.render import render_dashboard

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
DASHBOARDS = {
    p.stem: json.loads(p.read_text()) for p in sorted((ROOT / "charts/keepwarm/dashboards").glob("*.json"))
}
DOCS = ROOT / "docs" / "dashboards"
TRAFFIC_S = 8.0
WC, APPS, QUOTA = "kwobs", "kwobs-apps", "kwobs-no-daemonsets"


def small_checkpoint(path: Path, seed: int, rows: int) -> Path:
    """A raw safetensors checkpoint (the daemon loads bytes; no architecture needed to stay resident)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    save_file({"w.weight": torch.randn(rows, 1024, generator=g).bfloat16()}, path / "model.safetensors")
    (path / "config.json").write_text('{"architectures": ["TinyForTest"], "model_type": "tiny"}')
    return path


def start_node_cache(root: Path, tiny: Path, metrics_port: int) -> DaemonProcess:
    """tiny (pinned, float32) + two 2 MiB models under a budget that holds only one of them."""
    a = small_checkpoint(root / "models" / "a", seed=1, rows=512)
    b = small_checkpoint(root / "models" / "b", seed=2, rows=511)
    budget = plan_layout(read_checkpoint(tiny), torch.float32).size + (3 << 20)
    args = [
        "--dtype",
        "float32",
        "--budget",
        str(budget),
        "--pin",
        tiny.name,
        "--metrics-port",
        str(metrics_port),
    ]
    return DaemonProcess(root / "sockets", [tiny, a, b], *args).wait_ready()


def send_traffic(base_url: str, seconds: float, clients: int = 4) -> int:
    """Chat (plain and streamed), completions and one invalid request per round, from several
    clients, each of which first abandons one long stream."""
    from openai import BadRequestError, OpenAI

    deadline = time.monotonic() + seconds
    done: list[int] = []
    errors: list[BaseException] = []

    def rounds(client: OpenAI) -> None:
        long = client.completions.create(model="tiny", prompt="Count:", max_tokens=200, stream=True)
        next(iter(long))
        long.close()  # went away mid-stream: the server aborts the request
        messages = [{"role": "user", "content": "Tell me about caches."}]
        while time.monotonic() < deadline:
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=12)
            for _ in client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=12, stream=True
            ):
                pass
            client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8)
            try:
                client.chat.completions.create(model="tiny", messages=messages, max_tokens=-1)
                raise AssertionError("max_tokens=-1 was accepted")
            except BadRequestError:
                pass
            done.append(1)

    def client_loop() -> None:
        try:
            rounds(OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60))
        except BaseException as exc:  # reported by the caller: a thread's exception is otherwise lost
            errors.append(exc)

    threads = [threading.Thread(target=client_loop) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return len(done)


def run_operator_with_a_failure(cp, op: OperatorProcess) -> None:
    """WeightCache + InferenceDeployment; DaemonSets are forbidden by quota at first, then allowed."""
    install_crds(cp)
    install_chart_rbac(cp)
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": QUOTA, "namespace": NAMESPACE},
        "spec": {"hard": {"count/daemonsets.apps": "0"}},
    }
    cp.kubectl("apply", "-f", "-", input=json.dumps(quota))
    cp.kubectl("create", "namespace", APPS, check=False)
    op.start()
    cache = {
        "apiVersion": "keepwarm.dev/v1alpha1",
        "kind": "WeightCache",
        "metadata": {"name": WC},
        "spec": {
            "tier": "host",
            "nodeSelector": {"pool": "kwobs-none"},
            "models": [{"name": "tiny", "source": {"path": "/var/lib/models/tiny"}}],
        },
    }
    serving = {
        "apiVersion": "keepwarm.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": "chat", "namespace": APPS},
        "spec": {"model": {"cacheRef": WC, "name": "tiny"}, "replicas": 1, "gpusPerPod": 0},
    }
    cp.kubectl("apply", "-f", "-", input=json.dumps(cache))
    cp.kubectl("apply", "-f", "-", input=json.dumps(serving))
    cp.wait_for(lambda: "keepwarm_operator_reconcile_errors_total{" in op.metrics(), timeout_s=90,
                what=f"a failed reconcile (log {op.log})")  # fmt: skip
    cp.kubectl("delete", "resourcequota", QUOTA, "-n", NAMESPACE)
    cp.wait_for(lambda: 'keepwarm_operator_applies_total{kind="DaemonSet"}' in op.metrics(), timeout_s=90,
                what=f"the DaemonSet applied after the quota went (log {op.log})")  # fmt: skip


def cleanup_operator(cp, op: OperatorProcess) -> None:
    cp.kubectl("delete", "resourcequota", QUOTA, "-n", NAMESPACE, "--ignore-not-found", check=False)
    cp.kubectl(
        "delete",
        "inferencedeployment",
        "chat",
        "-n",
        APPS,
        "--ignore-not-found",
        "--timeout=60s",
        check=False,
    )
    cp.kubectl("delete", "weightcache", WC, "--ignore-not-found", "--timeout=60s", check=False)
    op.stop()


def evaluate(prom: Prometheus, start: float, end: float) -> tuple[dict, list[str]]:
    """Every target of every panel: results per dashboard and panel id, and the list of failures."""
    results: dict[str, dict[int, list[tuple[str, list[Series]]]]] = {}
    failures = []
    for name, dashboard in DASHBOARDS.items():
        per_panel = results[name] = {}
        for panel in (p for p in dashboard["panels"] if p["type"] != "row"):
            per_panel[panel["id"]] = []
            for target in panel["targets"]:
                try:
                    series = prom.query_range(grafana_to_promql(target["expr"]), start, end)
                except Exception as exc:
                    failures.append(f"{name} / {panel['title']}: {exc}")
                    continue
                if not any(not math.isnan(v) for s in series for _, v in s.points):
                    failures.append(f"{name} / {panel['title']}: no data for {target['expr']}")
                per_panel[panel["id"]].append((target["legendFormat"], series))
    return results, failures


def test_every_panel_query_returns_series_from_real_processes(control_plane, tiny_llama, tmp_path):
    cp = control_plane
    server_port, cache_metrics_port, prom_port = free_port(), free_port(), free_port()
    op = OperatorProcess(cp, tmp_path, priority=10)  # below the e2e operators' priorities
    jobs = {
        "keepwarm-runtime": [f"127.0.0.1:{server_port}"],
        "keepwarm-agent": [f"127.0.0.1:{cache_metrics_port}"],
        "keepwarm-operator": [f"127.0.0.1:{op.metrics_port}"],
    }
    try:
        prom = Prometheus(tmp_path / "prometheus", prom_port, jobs).wait_ready()
    except PrometheusMissing as exc:
        pytest.fail(str(exc), pytrace=False)
    start = time.time()
    daemon = server = None
    try:
        daemon = start_node_cache(tmp_path / "cache", tiny_llama, cache_metrics_port)
        run_operator_with_a_failure(cp, op)
        common = ["--served-model-name", "tiny", "--cache-socket-dir", str(tmp_path / "cache" / "sockets")]
        common += ["--max-model-len", "256", "--num-kv-blocks", "64", "--max-num-seqs", "8"]
        sources = []
        for dtype in ("bfloat16", "float32"):  # cold: the cache holds float32, so disk; warm: attach
            server = start_server(tiny_llama, tmp_path / f"serve-{dtype}.log", port=server_port,
                                  args=[*common, "--dtype", dtype])  # fmt: skip
            server.wait("/ready", timeout=300)
            sources.append(next(k for k in server.metrics() if k.startswith("keepwarm_weight_load_seconds{")))
            assert send_traffic(server.url, TRAFFIC_S) > 0
            time.sleep(3 * SCRAPE_INTERVAL_S)
            if dtype == "bfloat16":
                assert server.stop() is not None
        assert 'source="disk"' in sources[0] and 'source="cache"' in sources[1], sources
        end = time.time()
        up = {s.labels["job"]: max(v for _, v in s.points) for s in prom.query_range("up", start, end)}
        assert up == dict.fromkeys(jobs, 1.0), up
        results, failures = evaluate(prom, start, end)
        assert failures == [], "\n".join(failures)
        out = DOCS if os.environ.get("KEEPWARM_DOCS_PNG") == "1" else tmp_path / "png"
        for name, dashboard in DASHBOARDS.items():
            png = render_dashboard(dashboard, results[name], start, out / f"{name}.png")
            assert png.stat().st_size > 10_000
    finally:
        if server is not None:
            server.stop()
        if daemon is not None:
            daemon.kill()
        cleanup_operator(cp, op)
        prom.stop()
