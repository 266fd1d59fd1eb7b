"""`keepwarm-operator run` flags become one OperatorSettings; the CLI never edits os.environ."""

import os

from keepwarm_operator.cli import build_parser, settings_from
from keepwarm_operator.settings import OperatorSettings


def test_flags_become_settings_without_touching_the_environment():
    before = dict(os.environ)
    args = build_parser({}).parse_args(
        ["run", "--namespace", "a", "--namespace", "b", "--agent-namespace", "agents",
         "--resync-seconds", "1", "--workers", "3", "--kubeconfig", "/kc"]
    )  # fmt: skip
    assert settings_from(args) == OperatorSettings(
        agent_namespace="agents",
        namespaces=frozenset({"a", "b"}),
        resync_seconds=1.0,
        workers=3,
        kubeconfig="/kc",
    )
    assert dict(os.environ) == before


def test_environment_supplies_defaults_and_flags_win():
    env = {"KEEPWARM_AGENT_NAMESPACE": "from-env", "KEEPWARM_OPERATOR_RESYNC_SECONDS": "7"}
    settings = settings_from(build_parser(env).parse_args(["run"]))
    assert (settings.agent_namespace, settings.resync_seconds) == ("from-env", 7.0)
    assert settings.namespaces == frozenset() and settings.kubeconfig is None
    flagged = settings_from(build_parser(env).parse_args(["run", "--resync-seconds", "2"]))
    assert flagged.resync_seconds == 2.0


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
