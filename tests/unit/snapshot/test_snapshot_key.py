"""snapshot/key.py: what goes into a snapshot's key, what never does, and mismatches by field."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from keepwarm_runtime.snapshot.key import (
    SnapshotKey,
    code_path_env,
    cpu_identity,
    differing,
    env_identity,
    import_env,
    model_identity,
    snapshot_key,
    this_process_user,
)

POD_ENV = {
    "HF_HOME": "/data/hf",
    "OMP_WAIT_POLICY": "PASSIVE",
    "PYTHONHASHSEED": "0",
    "HF_TOKEN": "hf_secret",
    "HUGGING_FACE_HUB_TOKEN": "hf_secret",
    "AWS_SECRET_ACCESS_KEY": "x",
    "OMP_NUM_THREADS": "4",
    "KEEPWARM_API_KEY": "sk-1",
    "KEEPWARM_PORT": "8000",
    "PATH": "/usr/bin",
    "LD_PRELOAD": "/evil.so",
    "MY_SERVICE_HOST": "10.0.0.1",
}


def test_import_variables_pass_and_secrets_settings_and_code_paths_do_not() -> None:
    assert import_env(POD_ENV) == {"HF_HOME": "/data/hf", "OMP_WAIT_POLICY": "PASSIVE", "PYTHONHASHSEED": "0"}
    assert code_path_env(POD_ENV) == {"PATH": "/usr/bin", "LD_PRELOAD": "/evil.so"}


def test_the_env_identity_follows_imports_and_code_paths_not_secrets_or_pod_facts() -> None:
    base = env_identity(POD_ENV)
    assert env_identity({**POD_ENV, "HF_TOKEN": "another"}) == base
    assert env_identity({**POD_ENV, "MY_SERVICE_HOST": "10.0.0.2", "OMP_NUM_THREADS": "8"}) == base
    assert env_identity({**POD_ENV, "PYTHONPATH": "/elsewhere"}) != base
    assert env_identity({**POD_ENV, "HF_HOME": "/other"}) != base


def test_the_model_identity_names_kind_type_and_architectures_and_follows_every_byte() -> None:
    config = json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}).encode()
    identity = model_identity(config)
    assert identity.startswith("text llama LlamaForCausalLM ")
    assert model_identity(config + b" ") != identity
    assert model_identity(json.dumps({"model_type": "whisper"}).encode()).startswith("speech whisper - ")
    assert model_identity(b"not json").startswith("text - - ")


def test_the_cpu_identity_is_the_flags_as_a_set() -> None:
    cpuinfo = "processor\t: 0\nflags\t\t: sse avx2 fma\n\nprocessor\t: 1\nflags\t\t: sse avx2 fma\n"
    assert cpu_identity(cpuinfo) == cpu_identity("flags : fma sse avx2\n")
    assert cpu_identity(cpuinfo) != cpu_identity("flags : fma sse avx2 avx512f\n")


def _key(**changes: object) -> SnapshotKey:
    base = SnapshotKey(1, "0.1.0", "p", "s", "py", "m", "cpu", "e", "c", "6.1", "4.1.1", "0:0:")
    return replace(base, **changes)


def test_keys_differ_by_named_fields_and_their_digests_differ() -> None:
    assert differing(_key(), _key()) == []
    assert differing(_key(), _key(cpu="other", criu="4.2")) == ["cpu", "criu"]
    assert _key().digest() == _key().digest()
    assert len({_key(**{f: "x"}).digest() for f in ("packages", "model", "env", "kernel", "user")}) == 5


@pytest.mark.parametrize(
    "wire",
    [
        None,
        [],
        {"format": 1},
        {**_key().wire(), "extra": "x"},
        {**_key().wire(), "format": "1"},
        {**_key().wire(), "cpu": 3},
    ],
)
def test_a_key_from_the_wire_is_refused_unless_it_is_exactly_a_key(wire: object) -> None:
    with pytest.raises(ValueError, match="snapshot key"):
        SnapshotKey.from_wire(wire)
    assert SnapshotKey.from_wire(_key().wire()) == _key()


def test_this_process_computes_one_key_and_its_user_is_its_own() -> None:
    import os

    config = b'{"model_type": "llama"}'
    first = snapshot_key(config, os.environ, "4.1.1", this_process_user())
    assert first == snapshot_key(config, os.environ, "4.1.1", this_process_user())
    assert first.user.startswith(f"{os.getuid()}:{os.getgid()}:")
    assert differing(first, snapshot_key(config, os.environ, "4.2", this_process_user())) == ["criu"]
