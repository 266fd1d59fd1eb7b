"""`keepwarm serve` flags: every flag from KEEPWARM_* too, flags win; one ServeSettings results, and
one EngineConfig from it that the background attach and the engine both take."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from keepwarm_runtime.server import cli
from keepwarm_runtime.server.settings import ServeSettings


def parse(argv: list[str]) -> ServeSettings:
    return cli.serve_settings(cli.parse_serve_argv(argv))


def test_defaults(monkeypatch):
    for name in (
        "KEEPWARM_PORT",
        "KEEPWARM_CACHE_SOCKET_DIR",
        "KEEPWARM_CACHE_FALLBACK",
        "KEEPWARM_MODEL_DIR",
    ):
        monkeypatch.delenv(name, raising=False)
    args = parse(["/models/m"])
    assert (args.model_dir, args.host, args.port) == ("/models/m", "0.0.0.0", 8000)
    config = cli.engine_config(args)
    assert config.given_values() == {  # unset ones (cache_socket_dir) keep EngineConfig's default
        "cache_mode": "zero_copy",
        "cache_fallback": True,
    }
    assert args.cache_socket_dir is None and config.cache_socket_dir is None
    assert (config.model_dir, config.max_num_seqs) == ("/models/m", 64)


def test_env_supplies_every_flag_and_flags_win(monkeypatch):
    monkeypatch.setenv("KEEPWARM_MODEL_DIR", "/models/from-env")
    monkeypatch.setenv("KEEPWARM_PORT", "9001")
    monkeypatch.setenv("KEEPWARM_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("KEEPWARM_DTYPE", "bfloat16")
    monkeypatch.setenv("KEEPWARM_CACHE_SOCKET_DIR", "/var/run/keepwarm/wc")
    monkeypatch.setenv("KEEPWARM_CACHE_MODE", "copy")
    monkeypatch.setenv("KEEPWARM_CACHE_FALLBACK", "false")
    monkeypatch.setenv("KEEPWARM_SERVED_MODEL_NAME", "envname")
    args = parse([])
    assert (args.model_dir, args.port, args.served_model_name) == ("/models/from-env", 9001, "envname")
    assert cli.engine_config(args).given_values() == {
        "cache_socket_dir": "/var/run/keepwarm/wc",
        "cache_mode": "copy",
        "cache_fallback": False,
        "max_num_seqs": 7,
        "dtype": "bfloat16",
    }
    args = parse(
        ["/models/flag", "--port", "9002", "--max-num-seqs", "3", "--cache-fallback", "--dtype", "float32"]
    )
    config = cli.engine_config(args)
    assert (args.model_dir, args.port) == ("/models/flag", 9002)
    assert (config.max_num_seqs, config.cache_fallback, config.dtype) == (3, True, "float32")


def test_trusted_uids_and_the_kernel_folder_reach_the_engine_config(monkeypatch, capsys):
    """KEEPWARM_CACHE_TRUSTED_UIDS and KEEPWARM_KERNEL_CACHE are serve settings, resolved at the entry
    point and handed down in the one EngineConfig; the kernel folder is where the pod mounts the node's
    builds, not a setting the user gave (an engine that builds no kernel is not refused it)."""
    from keepwarm_runtime.engine.prefetch import AttachRequest, AttachSettings

    monkeypatch.setenv("KEEPWARM_CACHE_TRUSTED_UIDS", "1000, 1001")
    monkeypatch.setenv("KEEPWARM_KERNEL_CACHE", "/var/lib/keepwarm/kernels")
    config = cli.engine_config(parse(["/m"]))
    assert config.cache_trusted_uids == {1000, 1001}
    request = AttachRequest(AttachSettings.of(config), online=None, expert_layout="model")
    assert request.arguments()["trusted_uids"] == {1000, 1001}  # what attach() is given
    assert config.kernel_cache == "/var/lib/keepwarm/kernels" and "kernel_cache" not in config.given
    assert cli.engine_config(parse(["/m", "--cache-trusted-uid", "7"])).cache_trusted_uids == {7}
    monkeypatch.setenv("KEEPWARM_CACHE_TRUSTED_UIDS", "1000 1001")  # a bad value: refused at start
    assert cli.run(cli.parse_serve_argv(["/m"])) == 2
    assert "KEEPWARM_CACHE_TRUSTED_UIDS='1000 1001' is not valid" in capsys.readouterr().err


def test_bad_env_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("KEEPWARM_PORT", "eighty")
    with pytest.raises(SystemExit, match="KEEPWARM_PORT"):
        parse([])


def test_missing_model_dir_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.delenv("KEEPWARM_MODEL_DIR", raising=False)
    assert cli.run(cli.parse_serve_argv([])) == 2
    assert "KEEPWARM_MODEL_DIR" in capsys.readouterr().err


def test_empty_variables_mean_the_default(monkeypatch):
    for name in ("KEEPWARM_PORT", "KEEPWARM_CACHE_FALLBACK", "KEEPWARM_API_KEY", "KEEPWARM_MAX_NUM_SEQS"):
        monkeypatch.setenv(name, "  ")
    settings = parse(["/m"])
    assert (settings.port, settings.cache_fallback, settings.api_key) == (8000, True, None)
    assert "max_num_seqs" not in cli.engine_config(settings).given


def test_bad_flag_value_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit):
        cli.parse_serve_argv(["/m", "--cache-mode", "mmap"])
    assert "--cache-mode" in capsys.readouterr().err


def test_engine_settings_are_engine_config_fields():
    """The engine group is handed to EngineConfig as keyword arguments: every name must be a field,
    and the types must agree, or `keepwarm serve` would fail only at load time."""
    import dataclasses
    import typing

    from keepwarm_api.settings import specs
    from keepwarm_runtime.engine.config import EngineConfig

    hints = typing.get_type_hints(EngineConfig)
    engine = [s for s in specs(ServeSettings) if s.meta.group == "engine"]
    assert {s.name for s in engine} <= {f.name for f in dataclasses.fields(EngineConfig)}
    for spec in engine:
        accepted = set(typing.get_args(hints[spec.name])) or {hints[spec.name]}
        assert spec.kind in accepted, (spec.name, hints[spec.name])


def test_lora_flags_turn_lora_on_unless_it_is_turned_off():
    assert "enable_lora" not in cli.engine_config(parse(["/m"])).given
    assert cli.engine_config(parse(["/m", "--allow-runtime-lora-updating"])).enable_lora is True
    assert cli.engine_config(parse(["/m", "--lora-modules-file", "/adapters.json"])).enable_lora is True
    assert cli.engine_config(parse(["/m", "--lora-modules", "a=/a", "--no-enable-lora"])).enable_lora is False


def test_a_value_the_engine_refuses_is_refused_before_serving(monkeypatch):
    monkeypatch.delenv("KEEPWARM_MAX_NUM_SEQS", raising=False)
    with pytest.raises(ValueError, match="max_num_seqs must be at least 1, got 0"):
        cli.engine_config(parse(["/m", "--max-num-seqs", "0"]))


def test_one_engine_config_reaches_the_prefetch_and_the_engine(tiny_llama: Path, monkeypatch):
    """serve() builds the EngineConfig once (server_start); the background attach and the engine take
    that one object, so the weights attached in the background are the engine's own."""
    from keepwarm_runtime.engine.threads import choose_threads

    for name in cli.serve_env_vars():
        monkeypatch.delenv(name, raising=False)
    argv = [str(tiny_llama), "--dtype", "float32", "--attention-backend", "torch", "--num-kv-blocks", "8"]
    server = cli.server_start(parse(argv), choose_threads(1), openmp_prepared=False)
    prefetch = server.prefetch()
    engine = server.make_engine(time.time(), prefetch, load_first=True)

    assert prefetch.config is server.engine_config and engine.config is server.engine_config
    assert engine.startup.weights_prefetched  # taken from the background attach, not attached again
    assert engine.config.given_values() == {
        "cache_mode": "zero_copy",
        "cache_fallback": True,
        "dtype": "float32",
        "num_kv_blocks": 8,
        "attention_backend": "torch",
    }
    assert next(engine.model.parameters()).dtype == engine.config.torch_dtype


def test_threads_flag_and_env(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("KEEPWARM_THREADS", "3")
    assert parse(["/m"]).threads == 3
    assert parse(["/m", "--threads", "1"]).threads == 1
    assert cli.serve(parse([str(tmp_path), "--threads", "0"])) == 2
    assert "--threads must be at least 1" in capsys.readouterr().err
