"""`keepwarm serve` speaks vLLM's command line: `--lora-modules` with several values after one flag and
vLLM's JSON entries, vLLM's spellings of flags keepwarm implements, and every other `vllm serve` flag
it knows refused by name with what to use instead (or accepted where keepwarm already behaves so)."""

from __future__ import annotations

import pytest

from keepwarm_api.settings import foreign_table, specs
from keepwarm_runtime.server import cli
from keepwarm_runtime.server.base.lora_modules import LoraModule
from keepwarm_runtime.server.settings import ServeSettings


@pytest.fixture(autouse=True)
def _no_serve_variables(monkeypatch):
    for name in cli.serve_env_vars():
        monkeypatch.delenv(name, raising=False)


def parse(argv: list[str]) -> ServeSettings:
    return cli.serve_settings(cli.parse_serve_argv(argv))


def refusal(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as stop:
        parse(argv)
    assert stop.value.code == 2 or isinstance(stop.value.code, str)
    return capsys.readouterr().err + (stop.value.code if isinstance(stop.value.code, str) else "")


def test_several_adapters_after_one_flag_as_vllm_documents_it():
    settings = parse(["/m", "--lora-modules", "sql=/a/sql", "chat=/a/chat"])
    assert settings.lora_modules == (LoraModule("sql", "/a/sql"), LoraModule("chat", "/a/chat"))


def test_vllm_json_entries_several_after_one_flag_and_mixed_with_name_path():
    sql = '{"name": "sql", "path": "/a/sql", "base_model_name": "base"}'
    chat = '{"name": "chat", "path": "/a/chat"}'
    settings = parse(["/m", "--lora-modules", sql, chat, "de=/a/de"])
    assert settings.lora_modules == (
        LoraModule("sql", "/a/sql", "base"),
        LoraModule("chat", "/a/chat"),
        LoraModule("de", "/a/de"),
    )


def test_the_repeated_flag_still_adds_up_with_several_values():
    settings = parse(["--lora-modules", "a=/a", "b=/b", "--lora-modules", "c=/c", "--", "/m"])
    assert [m.name for m in settings.lora_modules] == ["a", "b", "c"]
    assert settings.model_dir == "/m"
    assert cli.engine_config(settings).enable_lora is True


def test_a_bad_entry_among_several_is_refused_naming_it(capsys):
    err = refusal(["/m", "--lora-modules", "a=/a", '{"name": "b"}'], capsys)
    assert "--lora-modules" in err and "name and path" in err
    err = refusal(["/m", "--lora-modules", "a=/a", "nopath"], capsys)
    assert "'nopath' is not name=path" in err


def test_vllm_spellings_of_flags_keepwarm_implements():
    settings = parse(["/m", "--num-gpu-blocks-override", "12", "-q", "fp8", "--dtype", "half"])
    config = cli.engine_config(settings)
    assert (config.num_kv_blocks, config.quantization, config.dtype) == (12, "fp8", "float16")
    assert cli.engine_config(parse(["/m", "--dtype", "float"])).dtype == "float32"


def test_vllms_parallel_flags_and_their_short_forms_are_keepwarms():
    for argv in (["--tensor-parallel-size", "2", "--enable-expert-parallel"], ["-tp", "2", "-ep"]):
        config = cli.engine_config(parse(["/m", *argv]))
        assert (config.tensor_parallel_size, config.enable_expert_parallel) == (2, True), argv
    unset = cli.engine_config(parse(["/m"]))
    assert (unset.tensor_parallel_size, unset.enable_expert_parallel) == (1, False)
    assert "tensor_parallel_size" not in unset.given


def test_prefix_caching_is_vllms_flag_both_ways():
    assert "enable_prefix_caching" not in cli.engine_config(parse(["/m"])).given
    assert cli.engine_config(parse(["/m", "--no-enable-prefix-caching"])).enable_prefix_caching is False
    assert cli.engine_config(parse(["/m", "--enable-prefix-caching"])).enable_prefix_caching is True


@pytest.mark.parametrize("entry", [f for f in ServeSettings.FOREIGN_FLAGS if f.refuse], ids=lambda f: f.flag)
def test_every_refused_vllm_flag_is_refused_by_name_with_what_to_use_instead(entry, capsys):
    for spelling in entry.flags:
        err = refusal(["/m", spelling], capsys)
        assert f"{spelling} is not implemented by keepwarm: {entry.answer}" in err
    err = refusal(["/m", f"{entry.flag}=2"], capsys)  # with a value, in either form
    assert f"{entry.flag} is not implemented by keepwarm" in err
    err = refusal([entry.flag, "2", "/m"], capsys)
    assert f"{entry.flag} is not implemented by keepwarm" in err


def test_accepted_vllm_flags_change_nothing_keepwarm_does_not_already_do(monkeypatch):
    plain = parse(["/m"])
    same = parse(["/m", "--enable-chunked-prefill", "--disable-log-requests", "--disable-log-stats"])
    assert same == plain


def test_enforce_eager_is_vllms_flag_for_keepwarms_setting(monkeypatch):
    assert parse(["/m"]).enforce_eager is None  # the engine's default: decode graphs on CUDA
    assert parse(["/m", "--enforce-eager"]).enforce_eager is True
    monkeypatch.setenv("KEEPWARM_ENFORCE_EAGER", "true")
    assert parse(["/m"]).enforce_eager is True


def test_async_scheduling_is_vllms_flag_both_ways(monkeypatch):
    assert parse(["/m"]).async_scheduling is None  # the engine's default: on CUDA only
    assert parse(["/m", "--async-scheduling"]).async_scheduling is True
    assert parse(["/m", "--no-async-scheduling"]).async_scheduling is False
    monkeypatch.setenv("KEEPWARM_ASYNC_SCHEDULING", "false")
    assert parse(["/m"]).async_scheduling is False


def test_vllm_access_log_switch_stands_for_keepwarms_setting(monkeypatch):
    monkeypatch.setenv("KEEPWARM_ACCESS_LOG", "true")
    assert parse(["/m"]).access_log is True
    assert parse(["/m", "--disable-uvicorn-access-log"]).access_log is False


def test_auto_tool_choice_needs_a_parser_as_in_vllm(capsys):
    assert (
        parse(["/m", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]).tool_call_parser
        == "hermes"
    )
    err = refusal(["/m", "--enable-auto-tool-choice"], capsys)
    assert "--enable-auto-tool-choice needs --tool-call-parser (or KEEPWARM_TOOL_CALL_PARSER)" in err


def test_abbreviated_flags_are_refused_not_guessed(capsys):
    err = refusal(["/m", "--max-num-seq", "3"], capsys)
    assert "unrecognized arguments: --max-num-seq" in err


def test_an_unknown_flag_is_refused_by_name(capsys):
    err = refusal(["/m", "--no-such-vllm-flag"], capsys)
    assert "--no-such-vllm-flag" in err


def test_the_docs_table_comes_from_the_declaration():
    table = foreign_table(ServeSettings)
    shared = [s.flag for s in specs(ServeSettings) if s.meta.shared]
    assert "--lora-modules" in shared and "--max-num-seqs" in shared
    for flag in shared:
        assert f"| `{flag}` | `{flag}` |" in table
    assert "| `--num-gpu-blocks-override` | `--num-kv-blocks` |" in table
    for entry in ServeSettings.FOREIGN_FLAGS:
        assert (
            f"| {', '.join(f'`{f}`' for f in entry.flags)} | {'refused' if entry.refuse else 'accepted'} |"
            in table
        )
    flags = [f for f in ServeSettings.FOREIGN_FLAGS for f in f.flags]
    assert len(flags) == len(set(flags))
