import json

import pytest
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer

from keepwarm_runtime.modelgen import build_tokenizer, parse_param_count
from keepwarm_runtime.modelgen.checkpoint import build_config


@pytest.mark.parametrize(
    ("text", "expected"), [("100M", 100_000_000), ("1.5B", 1_500_000_000), ("250000", 250_000), ("2k", 2000)]
)
def test_parse_param_count(text: str, expected: int) -> None:
    assert parse_param_count(text) == expected


def test_parse_param_count_rejects_garbage() -> None:
    with pytest.raises(ValueError, match="cannot parse"):
        parse_param_count("lots")


def test_build_config_hits_requested_size() -> None:
    from keepwarm_runtime.modelgen.checkpoint import _count_params

    config = build_config("llama", 100_000_000, 8192)
    assert abs(_count_params(config) - 100_000_000) / 100_000_000 < 0.15


def test_unknown_arch_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown architecture 'nope'"):
        build_config("nope", 1000, 8192)


def test_tokenizer_has_chat_template_and_one_bos() -> None:
    tokenizer = build_tokenizer(8192)
    assert len(tokenizer) == 8192
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text.startswith(tokenizer.bos_token)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer("hello")["input_ids"][0] == tokenizer.bos_token_id


def test_checkpoint_layout(tiny_llama) -> None:
    index = json.loads((tiny_llama / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 2
    for shard in shards:
        with safe_open(tiny_llama / shard, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                assert str(f.get_slice(name).get_dtype()) == "BF16"
    assert AutoConfig.from_pretrained(tiny_llama).model_type == "llama"
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    assert tokenizer.chat_template
    assert (tiny_llama / "generation_config.json").exists()


def make_model_cli(*argv: str) -> int:
    from keepwarm_runtime.cli import main

    return main(["make-model", *argv])


def test_make_model_writes_a_whisper_a_user_can_serve(tmp_path, capsys) -> None:
    from keepwarm_runtime.model_kind import ModelKind, detect_kind

    out = tmp_path / "whisper"
    assert make_model_cli(str(out), "--arch", "whisper", "--dtype", "float32") == 0
    assert json.loads(capsys.readouterr().out)["arch"] == "whisper"
    assert detect_kind(out) is ModelKind.SPEECH
    assert {"preprocessor_config.json", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in out.iterdir()
    }
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert {str(f.get_slice(name).get_dtype()) for name in f.keys()} == {"F32"}  # noqa: SIM118


def test_make_model_refuses_sizing_flags_for_an_audio_model(tmp_path, capsys) -> None:
    assert make_model_cli(str(tmp_path / "v"), "--arch", "voxtral", "--params", "1M", "--fp8") == 2
    assert "--params, --fp8 not for --arch voxtral" in capsys.readouterr().err
    assert not (tmp_path / "v").exists()


def test_the_tokenizer_folder_is_modelgens_one_setting(tmp_path) -> None:
    """KEEPWARM_CACHE_HOME, read by modelgen/settings.py by the settings layer's rule (empty: the
    default); the tokenizer takes the folder as an argument and keeps its training there."""
    from pathlib import Path

    from keepwarm_runtime.modelgen.settings import CACHE_HOME_ENV, cache_home

    assert CACHE_HOME_ENV == "KEEPWARM_CACHE_HOME"
    assert cache_home({CACHE_HOME_ENV: f" {tmp_path} "}) == tmp_path
    assert cache_home({CACHE_HOME_ENV: " "}) == cache_home({}) == Path.home() / ".cache" / "keepwarm"
    assert len(build_tokenizer(1024, cache_home=tmp_path)) == 1024
    assert [p.name.split("-")[:2] for p in (tmp_path / "tokenizers").glob("*.json")] == [["bpe", "1024"]]
