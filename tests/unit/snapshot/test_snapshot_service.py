"""snapshot/service.py: requests are answered by name, whatever they hold (no CRIU needed here: a
request that would start a take is refused by key, CRIU's version being unknown)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from keepwarm_runtime.cache.security import PeerPolicy
from keepwarm_runtime.snapshot.key import import_env, snapshot_key, this_process_user
from keepwarm_runtime.snapshot.service import ServiceSettings, SnapshotService
from keepwarm_runtime.snapshot.take import Requester

CONFIG = '{"model_type": "llama"}'


@pytest.fixture
def service(tmp_path: Path) -> SnapshotService:
    settings = ServiceSettings(tmp_path / "sockets", tmp_path / "store", "criu", None, None, PeerPolicy())
    return SnapshotService(settings)


def _me() -> Requester:
    return Requester(os.getuid(), os.getgid(), tuple(sorted(os.getgroups())))


def _request(**changes) -> dict:
    key = snapshot_key(CONFIG.encode(), os.environ, "4.1.1", this_process_user())
    return {
        "cmd": "snapshot",
        "key": key.wire(),
        "config_json": CONFIG,
        "env": import_env(os.environ),
        **changes,
    }


@pytest.mark.parametrize(
    ("request_", "code", "said"),
    [
        ({"cmd": "nope"}, "unknown_command", "unknown command 'nope'"),
        ({}, "unknown_command", "snapshot or restored"),
        ({"cmd": "restored", "key_digest": "../x"}, "bad_request", "key_digest"),
        ({"cmd": "restored", "key_digest": 7}, "bad_request", "key_digest"),
        (_request(key={"format": 1}), "bad_request", "key: a snapshot key has exactly the fields"),
        (_request(config_json=None), "bad_request", "config_json"),
        (_request(env={"A": 1}), "bad_request", "env must map"),
        (_request(env={"A\0": "1"}), "bad_request", "env must map"),
        (_request(env={str(i): "1" for i in range(600)}), "bad_request", "at most 512"),
    ],
)
def test_malformed_requests_are_refused_by_name(
    service: SnapshotService, request_: dict, code: str, said: str
) -> None:
    reply = service.handle(request_, _me())
    assert reply["ok"] is False and reply["error"]["code"] == code and said in reply["error"]["message"]


def test_a_key_the_agent_would_not_take_is_refused_naming_the_fields(service: SnapshotService) -> None:
    reply = service.handle(_request(), _me())  # this service knows no CRIU version yet: "criu" differs
    assert reply["error"]["code"] == "refused" and "(fields criu)" in reply["error"]["message"]
    other = Requester(os.getuid() + 1, os.getgid(), ())
    reply = service.handle(_request(), other)  # the kernel says another user than the key
    assert "user" in reply["error"]["message"]


def test_an_existing_snapshot_is_not_taken_again_and_unknown_restores_are_not_counted(
    service: SnapshotService, tmp_path: Path
) -> None:
    request = _request()
    (
        tmp_path / "store" / snapshot_key(CONFIG.encode(), os.environ, "4.1.1", this_process_user()).digest()
    ).mkdir(parents=True)
    assert service.handle(request, _me()) == {"ok": True, "state": "exists"}
    assert service.handle({"cmd": "restored", "key_digest": "ab" * 16}, _me()) == {
        "ok": True,
        "counted": False,
    }


def test_a_failed_hint_outside_the_damaged_reasons_is_refused(service: SnapshotService) -> None:
    reply = service.handle(_request(failed="restore_failed"), _me())
    assert reply["error"]["code"] == "bad_request" and "digest, manifest, files" in reply["error"]["message"]


def test_the_pid_floor_is_raised_with_threads(tmp_path: Path) -> None:
    from keepwarm_runtime.snapshot.take import raise_pid_floor

    real = Path("/proc/sys/kernel/ns_last_pid")
    now = int(real.read_text())
    assert raise_pid_floor(now + 20, real) >= now + 20  # each thread took a pid number
    assert raise_pid_floor(10, tmp_path / "missing") == 0  # no counter to read: nothing done
