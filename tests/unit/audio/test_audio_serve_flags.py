"""`keepwarm serve` audio flags: --audio-backend / KEEPWARM_AUDIO_BACKEND, start-up refusals."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from keepwarm_runtime.engine.config import EngineConfig
from keepwarm_runtime.model_kind import ModelKind
from keepwarm_runtime.server import cli
from keepwarm_runtime.server.openai.audio.serving import audio_settings, make_speech_engine
from keepwarm_runtime.server.settings import ServeSettings


def parse(argv: list[str]) -> ServeSettings:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    return cli.serve_settings(parser.parse_args(["serve", *argv]))


def test_flag_wins_over_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEPWARM_AUDIO_BACKEND", "pyav")
    monkeypatch.setenv("KEEPWARM_MAX_AUDIO_UPLOAD_BYTES", "1000")
    args = parse(["/m"])
    assert (args.audio_backend, args.max_audio_upload_bytes) == ("pyav", 1000)
    args = parse(["/m", "--audio-backend", "soundfile"])
    assert args.audio_backend == "soundfile"
    assert "KEEPWARM_AUDIO_BACKEND" in cli.serve_env_vars()


def test_settings_for_a_text_model_skip_the_backend_check(tmp_path: Path) -> None:
    settings = audio_settings("auto", 10, ModelKind.TEXT)
    assert (settings.backend, settings.max_upload_bytes) == ("auto", 10)
    with pytest.raises(ValueError, match="valid: auto, torchcodec, soundfile, pyav"):
        audio_settings("wav", 10, ModelKind.TEXT)
    with pytest.raises(ValueError, match="positive"):
        audio_settings("auto", 0, ModelKind.TEXT)


def test_the_backend_is_read_once_with_the_other_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEPWARM_AUDIO_BACKEND", "pyav")
    assert audio_settings(parse(["/m"]).audio_backend, 10, ModelKind.TEXT).backend == "pyav"
    assert audio_settings(None, 10, ModelKind.TEXT).backend == "auto"  # the variable is not read again


def test_unknown_backend_fails_at_start_up(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "keepwarm_runtime.cli", "serve", str(tmp_path), "--audio-backend", "ffmpeg"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "unknown audio backend 'ffmpeg'; valid: auto, torchcodec, soundfile, pyav" in proc.stderr


def test_whisper_refuses_engine_flags_it_cannot_honour(tmp_path: Path) -> None:
    config = EngineConfig.from_settings(str(tmp_path), max_model_len=10, num_kv_blocks=4, dtype="float32")
    with pytest.raises(ValueError, match="--max-model-len, --num-kv-blocks"):
        make_speech_engine(config, ModelKind.SPEECH)
    assert make_speech_engine(config, ModelKind.TEXT) is None  # LLMEngine's model


def test_whisper_takes_the_given_engine_settings_and_keeps_its_own_defaults(tmp_path: Path) -> None:
    from keepwarm_runtime.modelgen.whisper import make_whisper

    model_dir = str(make_whisper(tmp_path / "tiny-whisper"))
    given = make_speech_engine(EngineConfig.from_settings(model_dir, max_num_seqs=3), ModelKind.SPEECH)
    assert given.max_num_seqs == 3
    unset = EngineConfig.from_settings(model_dir, dtype="bfloat16")
    assert unset.max_num_seqs == 64  # EngineConfig's default, for LLMEngine ...
    engine = make_speech_engine(unset, ModelKind.SPEECH)
    assert engine.max_num_seqs == 32  # ... and Whisper's own, not given
    assert next(engine.model.parameters()).dtype == unset.torch_dtype


def test_missing_form_parser_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from starlette import formparsers

    from keepwarm_runtime.server.openai.audio.serving import require_multipart

    require_multipart()
    monkeypatch.setattr(formparsers, "multipart", None)
    with pytest.raises(RuntimeError, match=r"keepwarm-runtime\[audio\]"):
        require_multipart()


def test_media_allow_lists_are_off_by_default_and_read_the_env(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from keepwarm_runtime.server.base.media_fetch import media_policy

    args = parse(["/m"])
    assert (args.allowed_media_domains, args.allowed_local_media_path) == (None, None)
    default = audio_settings("auto", 10, ModelKind.TEXT).media
    assert (default.domains, default.local_root, default.max_bytes) == (frozenset(), None, 10)
    monkeypatch.setenv("KEEPWARM_ALLOWED_MEDIA_DOMAINS", "media.example.com")
    monkeypatch.setenv("KEEPWARM_ALLOWED_LOCAL_MEDIA_PATH", str(tmp_path))
    monkeypatch.setenv("KEEPWARM_MEDIA_FETCH_TIMEOUT", "2.5")
    args = parse(["/m", "--allowed-media-domains", "a.example,b.example"])
    policy = media_policy(
        args.allowed_media_domains,
        args.allowed_local_media_path,
        args.max_audio_upload_bytes,
        args.media_fetch_timeout,
    )
    assert (policy.domains, policy.local_root, policy.timeout_s) == (
        {"a.example", "b.example"},
        tmp_path.resolve(),
        2.5,
    )
    assert "KEEPWARM_ALLOWED_MEDIA_DOMAINS" in cli.serve_env_vars()


def test_bad_allow_list_fails_at_start_up(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "keepwarm_runtime.cli",
            "serve",
            str(tmp_path),
            "--allowed-media-domains",
            "https://media.example.com",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "'https://media.example.com' is not a host name" in proc.stderr
