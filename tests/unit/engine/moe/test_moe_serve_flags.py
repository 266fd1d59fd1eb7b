"""`keepwarm serve --moe-backend/--quantization` (and their KEEPWARM_* variables) reach EngineConfig."""

from __future__ import annotations

import argparse

import pytest

from keepwarm_runtime.engine.config import EngineConfig
from keepwarm_runtime.server.cli import add_serve_parser, engine_config, serve_settings


def _config(argv: list[str]) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    return engine_config(serve_settings(parser.parse_args(["serve", "/m", *argv])))


def test_flags_reach_engine_config() -> None:
    config = _config(["--moe-backend", "torch", "--quantization", "fp8"])
    assert (config.moe_backend, config.quantization) == ("torch", "fp8")


def test_environment_variables(monkeypatch) -> None:
    monkeypatch.setenv("KEEPWARM_MOE_BACKEND", "flashinfer_cutlass")
    monkeypatch.setenv("KEEPWARM_QUANTIZATION", "fp8")
    config = _config([])
    assert config.moe_backend == "flashinfer_cutlass" and config.quantization == "fp8"


@pytest.mark.parametrize(("field", "value"), [("moe_backend", "triton"), ("quantization", "awq")])
def test_unknown_values_are_refused_by_name(field, value) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(model_dir="/m", **{field: value})
