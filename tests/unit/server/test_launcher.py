"""server/launcher.py: the launcher knows whether its child supervises as the child itself decides it."""

from __future__ import annotations

from keepwarm_runtime.server.launcher import child_supervision


def test_the_child_supervision_is_resolved_by_the_settings_layer() -> None:
    assert child_supervision("/m", [], {}) == (True, None)
    assert child_supervision("/m", ["--no-supervise"], {}) == (False, None)
    assert child_supervision("/m", [], {"KEEPWARM_SUPERVISE": " Off "}) == (False, None)
    assert child_supervision("/m", ["--supervise"], {"KEEPWARM_SUPERVISE": "0"}) == (True, None)  # flag wins
    assert child_supervision("/m", [], {"KEEPWARM_SUPERVISOR_PORT": "9100"}) == (True, 9100)
    assert child_supervision("/m", ["--supervisor-port", "9101", "--no-supervise"], {}) == (False, None)
    assert child_supervision("/m", [], {"KEEPWARM_SUPERVISE": "maybe"}) == (False, None)  # the child exits 2
