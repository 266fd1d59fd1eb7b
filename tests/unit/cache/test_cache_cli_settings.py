"""`keepwarm cache ls|stats|release`: the socket's trusted owners come from KEEPWARM_CACHE_TRUSTED_UIDS,
resolved at the command's entry point; a bad value is one line naming it, exit 2, before any connect."""

from __future__ import annotations

from pathlib import Path

import pytest

from keepwarm_runtime.cache.cli import EXIT_BAD_INPUT
from keepwarm_runtime.cli import main


@pytest.mark.parametrize("command", [["ls"], ["stats"], ["release", "m"]])
def test_a_bad_trusted_uid_is_refused_by_name_before_connecting(tmp_path: Path, monkeypatch, capsys, command):
    socket = str(tmp_path / "host.sock")
    monkeypatch.setenv("KEEPWARM_CACHE_TRUSTED_UIDS", "root")
    assert main(["cache", command[0], "--socket", socket, *command[1:]]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert f"keepwarm cache {command[0]}: KEEPWARM_CACHE_TRUSTED_UIDS='root' is not valid" in err
    monkeypatch.setenv("KEEPWARM_CACHE_TRUSTED_UIDS", "0, 65534")  # good: on to the (missing) daemon
    assert main(["cache", command[0], "--socket", socket, *command[1:]]) == EXIT_BAD_INPUT
    assert "no daemon socket" in capsys.readouterr().err
