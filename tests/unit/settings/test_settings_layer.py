"""keepwarm_api.settings: one declaration gives flags, KEEPWARM_* variables, --help and the reference
pages' tables; one rule for empty values; the names the operator sets on pods are the ones programs read."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest

from keepwarm_api import podenv
from keepwarm_api.foreign import accepted, refused
from keepwarm_api.settings import (
    SettingError,
    add_arguments,
    env_names,
    foreign_table,
    group,
    markdown_table,
    parse_bool,
    present,
    resolve,
    setting,
)
from tests.unit.delivery.script_loader import load_script

ROOT = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class Demo:
    ENV_PREFIX: ClassVar[str] = "KW_TEST_"

    path: str | None = setting(None, "a positional path", positional=True)
    port: int = setting(8000, "port")
    ratio: float | None = setting(None, "a ratio", group="g")
    mode: str = setting("a", "a mode", choices=("a", "b"))
    verbose: bool = setting(False, "say more")
    tag: tuple[str, ...] = setting((), "repeatable tag")
    uid: frozenset[int] = setting(frozenset(), "repeatable uid", flag="--allow-uid")
    node: str | None = setting(None, "node", env="NODE_NAME")


@dataclass(frozen=True)
class Needs:
    where: str | None = setting(None, "required", required=True)
    count: int = setting(1, "count")


def settings(cls: type, argv: list[str], environ: dict[str, str]):
    parser = argparse.ArgumentParser()
    add_arguments(parser, cls)
    return resolve(cls, parser.parse_args(argv), environ)


def test_the_empty_rule():
    assert present(None) is None and present("") is None and present(" \t\n") is None
    assert present(" x ") == "x"
    assert [parse_bool(w) for w in ("1", "TRUE", "yes", "On", "0", "false", "NO", "off")] == [True] * 4 + [
        False
    ] * 4
    with pytest.raises(ValueError, match="not a boolean"):
        parse_bool("maybe")


def test_names_are_derived_once():
    assert env_names(Demo) == {
        "KW_TEST_PATH", "KW_TEST_PORT", "KW_TEST_RATIO", "KW_TEST_MODE", "KW_TEST_VERBOSE", "KW_TEST_TAG",
        "KW_TEST_UID", "NODE_NAME",
    }  # fmt: skip
    help_text = argparse.ArgumentParser()
    add_arguments(help_text, Demo)
    text = help_text.format_help()
    for piece in ("--port", "KW_TEST_PORT", "default: 8000", "--no-verbose", "--allow-uid", "env NODE_NAME"):
        assert piece in text, piece


def test_defaults_then_variables_then_flags():
    assert settings(Demo, [], {}) == Demo()
    env = {
        "KW_TEST_PATH": "/p", "KW_TEST_PORT": "9", "KW_TEST_RATIO": "0.5", "KW_TEST_MODE": "b",
        "KW_TEST_VERBOSE": "yes", "KW_TEST_TAG": "x, y,", "KW_TEST_UID": "1,2", "NODE_NAME": "n1",
    }  # fmt: skip
    from_env = settings(Demo, [], env)
    assert from_env == Demo("/p", 9, 0.5, "b", True, ("x", "y"), frozenset({1, 2}), "n1")
    flagged = settings(
        Demo, ["/q", "--port", "7", "--mode", "a", "--no-verbose", "--tag", "z", "--allow-uid", "3"], env
    )
    assert flagged == Demo("/q", 7, 0.5, "a", False, ("z",), frozenset({3}), "n1")
    assert group(flagged, "g") == {"ratio": 0.5} and group(Demo(), "g") == {}


def test_empty_variables_mean_the_default():
    blank = {name: " " for name in env_names(Demo)}
    assert settings(Demo, [], blank) == Demo()


@pytest.mark.parametrize(
    ("name", "value"), [("KW_TEST_PORT", "eighty"), ("KW_TEST_MODE", "c"), ("KW_TEST_VERBOSE", "perhaps")]
)
def test_a_bad_variable_is_refused_by_name(name, value):
    with pytest.raises(SettingError, match=f"{name}='{value}'"):
        settings(Demo, [], {name: value})


def test_a_bad_flag_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit):
        settings(Demo, ["--mode", "c"], {})
    assert "--mode" in capsys.readouterr().err


def test_required_settings_name_flag_and_variable_after_bad_values():
    with pytest.raises(SettingError, match=r"give --where \(or set KEEPWARM_WHERE\)"):
        settings(Needs, [], {})
    with pytest.raises(SettingError, match="KEEPWARM_COUNT"):  # a bad value is named first
        settings(Needs, [], {"KEEPWARM_COUNT": "x"})
    assert settings(Needs, [], {"KEEPWARM_WHERE": "/w"}).where == "/w"


def test_declarations_refuse_what_the_layer_cannot_generate():
    @dataclass(frozen=True)
    class Bad:
        x: dict = setting(None, "no")  # noqa: RUF009

    with pytest.raises(TypeError, match=r"Bad\.x"):
        markdown_table(Bad)
    with pytest.raises(TypeError, match="tuple"):
        setting([], "lists are mutable")


def test_reference_tables_are_generated_from_the_declarations():
    tables = load_script("flag_tables")
    for page in tables.PAGES:
        text = page.read_text()
        assert tables.rewrite(text, page) == text, f"{page} drifted: run python scripts/flag_tables.py"
    assert "| `--max-num-seqs` | `KEEPWARM_MAX_NUM_SEQS` |" in tables.FLAGS_PAGE.read_text()
    assert "| `--pipeline-parallel-size`, `-pp` | refused |" in tables.VLLM_PAGE.read_text()
    with pytest.raises(ValueError, match="flags:vllm"):
        tables.rewrite("no markers", tables.VLLM_PAGE)


def test_several_values_after_one_flag_aliases_and_foreign_flags():
    @dataclass(frozen=True)
    class Other:
        FOREIGN_PROGRAM: ClassVar[str] = "other"
        FOREIGN_FLAGS: ClassVar[tuple] = (
            refused("--gone", "-g", instead="use --tag"),
            accepted("--quiet", why="already quiet", sets=("loud", False)),
            accepted("--auto", why="needs a tag", requires="tag"),
        )

        tag: tuple[str, ...] = setting((), "tags", many=True, aliases=("--label",), shared=True)
        loud: bool = setting(True, "say more")

    def parse(argv: list[str]) -> Other:
        parser = argparse.ArgumentParser(allow_abbrev=False)
        add_arguments(parser, Other)
        return resolve(Other, parser.parse_args(argv), {})

    assert parse(["--tag", "a", "b", "--label", "c"]).tag == ("a", "b", "c")
    assert parse(["--quiet"]).loud is False
    assert parse(["--auto", "--tag", "x"]).tag == ("x",)
    with pytest.raises(SettingError, match=r"--auto needs --tag \(or KEEPWARM_TAG\)"):
        parse(["--auto"])
    with pytest.raises(SystemExit):
        parse(["-g", "1"])
    table = foreign_table(Other)
    assert "| `--tag` | `--tag` | the same flag: tags |" in table
    assert "| `--label` | `--tag` | another name for it: tags |" in table
    assert "| `--gone`, `-g` | refused | use --tag |" in table
    with pytest.raises(TypeError, match="many="):
        setting(None, "not repeatable", many=True)


def test_pod_variables_are_the_ones_the_programs_read():
    from keepwarm_runtime.cache.env import FALLBACK_ENV, MODE_ENV, SOCKET_DIR_ENV
    from keepwarm_runtime.cache.settings import CacheServeSettings
    from keepwarm_runtime.server.cli import serve_env_vars

    serve = serve_env_vars()
    assert {podenv.CACHE_SOCKET_DIR, podenv.CACHE_MODE, podenv.CACHE_FALLBACK} <= serve
    assert (SOCKET_DIR_ENV, MODE_ENV, FALLBACK_ENV) == (
        "KEEPWARM_CACHE_SOCKET_DIR",
        "KEEPWARM_CACHE_MODE",
        "KEEPWARM_CACHE_FALLBACK",
    )
    assert {podenv.CACHE_TRUSTED_UIDS, podenv.KERNEL_CACHE} <= serve
    agent = {
        podenv.NODE_NAME,
        podenv.POD_NAMESPACE,
        podenv.HOST_MODEL_ROOT,
        podenv.MODEL_ROOT,
        podenv.DOWNLOAD_ROOT,
    }
    assert agent <= env_names(CacheServeSettings)
    roots = ("KEEPWARM_HOST_MODEL_ROOT", "KEEPWARM_DOWNLOAD_ROOT")
    assert roots == (podenv.HOST_MODEL_ROOT, podenv.DOWNLOAD_ROOT)


def test_agent_settings_reach_the_node_agent_by_name():
    """The agent pod's downward-API namespace and its roots are `keepwarm cache serve` settings: the
    agent takes them as arguments, with the mounts of keepwarm_api.paths as their defaults."""
    from keepwarm_api.paths import HF_MOUNT, HOST_MODELS_MOUNT, MODELS_ROOT
    from keepwarm_runtime.agent.kubernetes import node_agent
    from keepwarm_runtime.cache.settings import CacheServeSettings

    env = {"KEEPWARM_CACHE_SOCKET_DIR": "/s", podenv.POD_NAMESPACE: "keepwarm-system"}
    env |= {podenv.HOST_MODEL_ROOT: "/h", podenv.MODEL_ROOT: "/m", podenv.DOWNLOAD_ROOT: "/d"}
    agent = node_agent([object()], settings(CacheServeSettings, ["--model-root", "/flag"], env), None)
    assert (agent.namespace, agent.host_root, agent.pvc_root, agent.hf_root) == (
        "keepwarm-system",
        "/h",
        "/flag",
        "/d",
    )
    agent.pool.shutdown()
    agent = node_agent(
        [object()], settings(CacheServeSettings, [], {"KEEPWARM_CACHE_SOCKET_DIR": "/s"}), None
    )
    assert (agent.namespace, agent.host_root, agent.pvc_root, agent.hf_root) == (
        "default",
        HOST_MODELS_MOUNT,
        MODELS_ROOT,
        HF_MOUNT,
    )
    agent.pool.shutdown()


def test_runtime_pods_get_only_variables_keepwarm_serve_reads():
    from keepwarm_api.inferencedeployment import InferenceDeploymentSpec
    from keepwarm_api.weightcache import WeightCacheSpec
    from keepwarm_operator.builders.runtime import CacheBinding, runtime_deployment
    from keepwarm_runtime.server.cli import serve_env_vars

    cache = WeightCacheSpec.model_validate({"models": [{"name": "m", "source": {"path": "/d"}}]})
    spec = InferenceDeploymentSpec.model_validate({"model": {"cacheRef": "wc", "name": "m"}})
    deployment = runtime_deployment("chat", "default", spec, CacheBinding("wc", cache, cache.models[0]), None)
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    names = {e["name"] for e in container["env"]}
    assert names and names <= serve_env_vars(), names - serve_env_vars()


def test_cache_serve_settings_reach_the_daemon_config_by_name():
    from keepwarm_runtime.cache.settings import CacheServeSettings
    from keepwarm_runtime.node import daemon_config

    env = {"KEEPWARM_CACHE_SOCKET_DIR": "/s", "KEEPWARM_CACHE_BUDGET": "1GiB", "KEEPWARM_CACHE_PINS": "a,b"}
    argv = ["--tier", "host", "--allow-uid", "5", "--allow-uid", "6", "--request-deadline", "2.5"]
    config = daemon_config(settings(CacheServeSettings, argv, env))
    assert (str(config.socket_dir), config.tier, config.budget) == ("/s", "host", 1 << 30)
    assert (config.pins, config.allow_uids, config.allow_gids) == ({"a", "b"}, {5, 6}, frozenset())
    assert (config.limits.max_connections_per_uid, config.limits.request_deadline_s) == (32, 2.5)
    with pytest.raises(SettingError, match="KEEPWARM_CACHE_BUDGET"):
        settings(CacheServeSettings, [], env | {"KEEPWARM_CACHE_BUDGET": "lots"})
