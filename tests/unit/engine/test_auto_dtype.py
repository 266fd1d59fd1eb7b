"""engine/auto_dtype.py: what `--dtype auto` picks from the checkpoint, the CPU's flags and the device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from keepwarm_runtime.engine import auto_dtype as a

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu vme sse2 avx2 avx512f {extra}
bugs\t\t: spectre_v1

processor\t: 1
flags\t\t: fpu
"""


def test_cpu_flags_come_from_the_first_flags_line():
    assert a.parse_cpu_flags(CPUINFO.format(extra="amx_bf16 amx_tile")) >= {"amx_bf16", "avx512f"}
    assert "amx_bf16" not in a.parse_cpu_flags(CPUINFO.format(extra=""))
    assert a.parse_cpu_flags("processor : 0\nFeatures : fp asimd\n") == frozenset()  # arm: no flags line


def test_a_cpuinfo_field_is_the_first_processors() -> None:
    text = CPUINFO.format(extra="") + "vmx flags\t: vnmi\nmodel name\t: AMD EPYC\n"
    assert a.cpuinfo_field(text, "vendor_id") == "GenuineIntel"
    assert a.cpuinfo_field(text, "flags").startswith("fpu vme") and "vnmi" not in a.cpuinfo_field(
        text, "flags"
    )
    assert a.cpuinfo_field(text, "model name") == "AMD EPYC" and a.cpuinfo_field(text, "stepping") == ""
    assert a.cpu_vendor() in ("GenuineIntel", "AuthenticAMD", "")


@pytest.mark.parametrize(
    ("config", "dtype"),
    [
        ({"dtype": "bfloat16"}, "bfloat16"),
        ({"torch_dtype": "float16"}, "float16"),  # the older key
        ({"text_config": {"dtype": "bfloat16"}}, "bfloat16"),  # multimodal
        ({"dtype": "float8_e4m3fn"}, None),  # not one the engine serves
        ({}, None),
    ],
)
def test_config_dtype(config, dtype):
    assert a.config_dtype(config) == dtype


@pytest.mark.parametrize(
    ("checkpoint", "flags", "device", "dtype"),
    [
        ("float32", {"amx_bf16"}, "cpu", "bfloat16"),  # AMX: bfloat16 even for a float32 checkpoint
        ("float16", {"avx512_bf16"}, "cpu", "bfloat16"),
        ("float32", {"avx512f", "avx2"}, "cpu", "float32"),  # no native bfloat16: the checkpoint's
        ("bfloat16", set(), "cpu", "bfloat16"),
        (None, set(), "cpu", "float32"),  # the checkpoint names none: float32, as transformers
        ("float32", {"amx_bf16"}, "cuda:0", "float32"),  # the CPU's flags say nothing about a GPU
        ("bfloat16", set(), "cuda", "bfloat16"),
    ],
)
def test_choose_dtype(checkpoint, flags, device, dtype):
    chosen, why = a.choose_dtype(checkpoint, frozenset(flags), device)
    assert chosen == dtype
    assert why


def test_auto_dtype_reads_the_checkpoint(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float16"}))
    assert a.auto_dtype(tmp_path, "cuda")[0] == "float16"  # a GPU: /proc/cpuinfo is not read
    assert a.auto_dtype(tmp_path / "missing", "cuda")[0] == "float32"


def test_serve_settings_resolve_auto_before_anything_takes_them(tmp_path: Path, monkeypatch):
    import argparse

    from keepwarm_runtime.engine.config import EngineConfig
    from keepwarm_runtime.server.cli import add_serve_parser, engine_config, serve_settings

    monkeypatch.delenv("KEEPWARM_DTYPE", raising=False)
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())

    def config(*argv: str) -> EngineConfig:
        return engine_config(serve_settings(parser.parse_args(["serve", str(tmp_path), *argv])))

    assert config("--dtype", "auto", "--device", "cuda").dtype == "float16"
    assert config("--dtype", "float32").dtype == "float32"  # anything else passes through
    assert "dtype" not in config().given  # unset: the engine's default
