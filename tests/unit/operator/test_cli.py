"""`keepwarm-operator run` flags become one OperatorSettings; the CLI never edits os.environ."""

import os

import pytest

from keepwarm_operator.cli import build_parser, settings_from
from keepwarm_operator.settings import OperatorSettings


def test_flags_become_settings_without_touching_the_environment():
    before = dict(os.environ)
    args = build_parser().parse_args(
        ["run", "--namespace", "a", "--namespace", "b", "--agent-namespace", "agents",
         "--resync-seconds", "1", "--workers", "3", "--kubeconfig", "/kc"]
    )  # fmt: skip
    assert settings_from(args, {}) == OperatorSettings(
        agent_namespace="agents",
        namespaces=frozenset({"a", "b"}),
        resync_seconds=1.0,
        workers=3,
        kubeconfig="/kc",
    )
    assert dict(os.environ) == before


def test_environment_supplies_defaults_and_flags_win():
    env = {"KEEPWARM_AGENT_NAMESPACE": "from-env", "KEEPWARM_OPERATOR_RESYNC_SECONDS": "7"}
    settings = settings_from(build_parser().parse_args(["run"]), env)
    assert (settings.agent_namespace, settings.resync_seconds) == ("from-env", 7.0)
    assert settings.namespaces == frozenset() and settings.kubeconfig is None
    flagged = settings_from(build_parser().parse_args(["run", "--resync-seconds", "2"]), env)
    assert flagged.resync_seconds == 2.0


def test_empty_variables_mean_the_default_and_bad_ones_are_named():
    empty = {"KEEPWARM_AGENT_NAMESPACE": "", "KEEPWARM_OPERATOR_WORKERS": " "}
    assert settings_from(build_parser().parse_args(["run"]), empty) == OperatorSettings()
    with pytest.raises(SystemExit, match="KEEPWARM_OPERATOR_WORKERS"):
        settings_from(build_parser().parse_args(["run"]), {"KEEPWARM_OPERATOR_WORKERS": "many"})


def test_resync_timer_period_comes_from_settings():
    import kopf

    from keepwarm_operator import handlers

    handlers.register(OperatorSettings(resync_seconds=1.5))
    timers = [
        h
        for h in kopf.get_default_registry()._spawning.get_all_handlers()
        if getattr(h, "interval", None) is not None
    ]
    plurals = {h.selector.any_name for h in timers if h.interval == 1.5}
    assert plurals == {"weightcaches", "inferencedeployments"}  # every owner object is resynced


def test_kopf_logs_in_with_the_kubeconfig_from_settings(tmp_path):
    import kopf

    from keepwarm_api.kubeconfig import client_configuration
    from keepwarm_operator.handlers.setup import connection_info

    kubeconfig = tmp_path / "kc.yaml"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: x\n"
        "clusters: [{name: c, cluster: {server: 'https://127.0.0.1:6443', insecure-skip-tls-verify: true}}]\n"
        "users: [{name: u, user: {token: abc123}}]\n"
        "contexts: [{name: x, context: {cluster: c, user: u}}]\n"
    )
    info = connection_info(client_configuration(str(kubeconfig)), kopf.OperatorSettings())
    assert (info.server, info.scheme, info.token, info.insecure) == (
        "https://127.0.0.1:6443",
        "Bearer",
        "abc123",
        True,
    )


def test_deployments_are_filtered_by_the_api_server():
    import kopf

    from keepwarm_operator.builders.meta import IDEP_LABEL
    from keepwarm_operator.handlers.setup import configure_watching

    settings = kopf.OperatorSettings()
    configure_watching(settings)
    (selector,) = list(settings.watching.label_selectors)
    assert (selector.group, selector.any_name) == ("apps", "deployments")
    assert settings.watching.label_selectors[selector] == IDEP_LABEL
