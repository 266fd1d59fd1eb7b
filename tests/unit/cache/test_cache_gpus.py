"""Which daemons `keepwarm cache serve` runs (cache/gpus.py), the fake-GPU twin, one /metrics for all."""

import subprocess
import sys

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from keepwarm_runtime.cache.backends.cuda import device_ordinal, format_uuid
from keepwarm_runtime.cache.gpus import GPU, DaemonPlan, GPUPlanError, fake_gpu_uuid, plan_daemons
from keepwarm_runtime.cache.metrics import DaemonMetrics, PerGPUCollector

TWO = [GPU(1, "GPU-b"), GPU(0, "GPU-a")]


def none() -> list[GPU]:
    return []


def test_uuid_bytes_print_as_nvidia_smi_does():
    raw = bytes.fromhex("5a3e3a0b9c1d4e2f8a7b6c5d4e3f2a1b")
    assert format_uuid(raw) == "GPU-5a3e3a0b-9c1d-4e2f-8a7b-6c5d4e3f2a1b"
    with pytest.raises(ValueError, match="16 bytes"):
        format_uuid(raw[:8])


def test_the_gpu_tiers_device_is_read_without_torch_as_torch_reads_it():
    import torch

    for spelling in ("cuda", "cuda:0", "cuda:3", torch.device("cuda:1"), torch.device("cuda")):
        assert device_ordinal(spelling) == (torch.device(spelling).index or 0)
    for bad in ("cpu", "cuda:x", "cuda:", "cuda:01", " cuda:1", "cuda:1:2", "mps:0", torch.device("cpu")):
        with pytest.raises(ValueError, match="needs a CUDA device"):
            device_ordinal(bad)
        assert not _torch_reads_cuda(bad)  # torch agrees: not a CUDA device


def _torch_reads_cuda(spelling) -> bool:
    import torch

    try:
        return torch.device(spelling).type == "cuda"
    except RuntimeError:
        return False


def test_one_daemon_unless_asked_for_every_gpu():
    assert plan_daemons("gpu", False, (), lambda: TWO) == [DaemonPlan("gpu", None)]
    assert plan_daemons("host", False, (), lambda: TWO) == [DaemonPlan("host", None)]


def test_all_gpus_runs_one_daemon_per_discovered_gpu_in_ordinal_order():
    plans = plan_daemons("gpu", True, (), lambda: TWO)
    assert plans == [DaemonPlan("gpu", "cuda:0"), DaemonPlan("gpu", "cuda:1")]
    assert plan_daemons("auto", True, (), lambda: TWO) == plans


def test_all_gpus_without_a_gpu():
    assert plan_daemons("auto", True, (), none) == [DaemonPlan("host", None)]  # auto: the host daemon
    with pytest.raises(GPUPlanError, match="sees no GPU"):
        plan_daemons("gpu", True, (), none)
    with pytest.raises(GPUPlanError, match="--tier host has one daemon"):
        plan_daemons("host", True, (), lambda: TWO)


def test_fake_gpus_are_host_backed_twins_and_never_discover():
    def refuse() -> list[GPU]:
        raise AssertionError("fake GPUs replace discovery")

    plans = plan_daemons("auto", False, ("GPU-f0", "GPU-f1"), refuse)
    assert plans == [DaemonPlan("host", None, "GPU-f0"), DaemonPlan("host", None, "GPU-f1")]
    assert plan_daemons("gpu", True, ("GPU-f0",), refuse) == plans[:1]
    with pytest.raises(GPUPlanError, match="--fake-gpu stands in for the gpu tier"):
        plan_daemons("host", False, ("GPU-f0",), refuse)
    with pytest.raises(GPUPlanError, match="GPU-f0 more than once"):
        plan_daemons("auto", False, ("GPU-f0", "GPU-f0"), refuse)


@pytest.mark.parametrize("text", ["", "../x", "GPU/0", "a.b", "-x", "x" * 101])
def test_fake_gpu_uuids_must_make_safe_socket_names(text):
    with pytest.raises(ValueError, match="fake GPU UUID"):
        fake_gpu_uuid(text)
    assert fake_gpu_uuid(" GPU-fake-0 ") == "GPU-fake-0"


def serve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "keepwarm_runtime.cli", "cache", "serve", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


def test_serve_refuses_gpu_settings_that_cannot_apply_by_name(tmp_path):
    host = serve("--socket-dir", str(tmp_path / "s"), "--tier", "host", "--fake-gpu", "GPU-f0")
    assert host.returncode == 2 and "--fake-gpu stands in for the gpu tier" in host.stderr
    bad = serve("--socket-dir", str(tmp_path / "s"), "--fake-gpu", "a/b")
    assert bad.returncode == 2 and "fake GPU UUID 'a/b'" in bad.stderr
    all_host = serve("--socket-dir", str(tmp_path / "s"), "--tier", "host", "--all-gpus")
    assert all_host.returncode == 2 and "--all-gpus applies to the gpu tier" in all_host.stderr


def test_one_metrics_page_for_every_gpu_daemon():
    a, b = DaemonMetrics(), DaemonMetrics()
    a.evictions.inc()
    b.resident_bytes.labels("m", "gpu").set(7)
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    registry.register(PerGPUCollector({"GPU-a": a.registry, "GPU-b": b.registry}))
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    evictions = {s.labels["gpu"]: s.value for s in families["keepwarm_cache_evictions"].samples
                 if s.name.endswith("_total")}  # fmt: skip
    assert evictions == {"GPU-a": 1.0, "GPU-b": 0.0}
    (resident,) = families["keepwarm_cache_resident_bytes"].samples
    assert resident.labels == {"model": "m", "tier": "gpu", "gpu": "GPU-b"} and resident.value == 7
