"""A snapshot's key: everything that makes a restored parent's memory right for this start.

A restored process is the memory of the process that was checkpointed: its imported modules, the
constants they computed from the environment, the code its CPU-feature checks chose, the files it
mapped. So the key names every input of that memory: the installed packages and keepwarm itself,
the interpreter, the model (what preload imported for it: its kind, model_type and architectures,
and the config.json bytes), the variables the imports read, the CPU's flags, the kernel, CRIU, and
the uid, gid and groups (an unprivileged restore cannot change credentials). The node agent computes
the key of the snapshot it takes from the same function, in the same image, and a pod restores only
a snapshot whose key equals its own, field by field; a mismatch names the fields.

Cheap by design (the launcher computes it before every start, with no heavy import): packages are
identified by their RECORD files' size and mtime (a reinstall changes them), keepwarm's own sources
by theirs (editable installs change without a RECORD), not by reading contents. The snapshot's bytes
are checked separately, by digest (store.py).

Environment (``import_env``): only variables an import may read pass into a snapshot's preload and
its key, and never one whose name looks secret (a snapshot is readable by every pod that may restore
it). The variables that choose *which code* runs (PATH, PYTHONPATH, LD_PRELOAD, ...) are the agent's
own in the process it checkpoints, never a pod's; the key carries their values, so a pod whose
values differ (another image) finds no snapshot instead of one that ran other code.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import keepwarm_runtime
from keepwarm_runtime.model_kind import kind_of

FORMAT = 2  # the layout of a snapshot and its manifest; another value is refused by key
# Variables an import may read: passed from the pod into the checkpointed preload, and keyed.
IMPORT_ENV_PREFIXES = (
    "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_",
    "TORCH", "PYTORCH_", "CUDA_", "NVIDIA_", "NCCL_", "TRITON_", "FLASHINFER_", "SAFETENSORS_", "LC_",
)  # fmt: skip
IMPORT_ENV_NAMES = frozenset({
    "HOME", "LANG", "LANGUAGE", "TZ", "XDG_CACHE_HOME", "PYTHONHASHSEED", "PYTHONDONTWRITEBYTECODE",
    "PYTHONUNBUFFERED", "PYTHONOPTIMIZE", "PYTHONWARNINGS", "PYTHONIOENCODING", "PYTHONUTF8",
})  # fmt: skip
# Variables that choose which code runs: the agent's own in the preload (never a pod's), keyed.
CODE_PATH_NAMES = frozenset({
    "PATH", "LD_LIBRARY_PATH", "LD_PRELOAD", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP",
    "PYTHONUSERBASE", "PYTHONNOUSERSITE", "PYTHONSAFEPATH", "PYTHONPLATLIBDIR", "VIRTUAL_ENV",
})  # fmt: skip
# Never passed into a snapshot, whatever their prefix (HF_TOKEN, ...): read afresh after the restore.
SECRET_MARKERS = ("TOKEN", "SECRET", "PASSWORD", "CREDENTIAL", "KEY", "AUTH")
# Per-process values an import reads but the parent sets again afterwards (threads.apply).
VOLATILE_NAMES = frozenset({"OMP_NUM_THREADS"})


@dataclass(frozen=True)
class SnapshotKey:
    """The inputs of a snapshot's memory. Short values are kept readable (a mismatch log names them);
    long ones are sha256 digests of their identity."""

    format: int  # FORMAT of the snapshot layout
    keepwarm: str  # keepwarm_runtime.__version__
    packages: str  # sha256 of every installed distribution's RECORD (name, size, mtime)
    source: str  # sha256 of keepwarm_runtime's and keepwarm_api's .py files (path, size, mtime)
    python: str  # sys.version, sys.prefix, the executable's real path with its size and mtime
    model: str  # "<kind> <model_type> <architectures> <sha256 of config.json, 16 hex>"
    device: str  # "cuda" or "cpu" (preload_device): a parent that will serve on CUDA imports FlashInfer
    env: str  # sha256 of import_env(...) plus the code-path variables
    cpu: str  # sha256 of /proc/cpuinfo's flags (the instruction sets import-time checks see)
    kernel: str  # os.uname().release
    criu: str  # CRIU's version (criu.py)
    user: str  # "uid:gid:g1,g2,..." of the checkpointed process, which the restorer must equal

    def digest(self) -> str:
        """The key's identity: the store's directory name of a snapshot with this key."""
        return _sha256(json.dumps(asdict(self), sort_keys=True).encode())[:32]

    def wire(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_wire(cls, data: object) -> SnapshotKey:
        """A key read from a manifest or a request; ValueError when it is not one."""
        names = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or set(data) != names:
            raise ValueError(f"a snapshot key has exactly the fields {', '.join(sorted(names))}")
        if not isinstance(data["format"], int) or not all(
            isinstance(data[n], str) for n in names - {"format"}
        ):
            raise ValueError("a snapshot key's fields are strings (format: an integer)")
        return cls(**data)


def differing(a: SnapshotKey, b: SnapshotKey) -> list[str]:
    """The names of the fields in which two keys differ (empty when equal)."""
    return [f.name for f in fields(SnapshotKey) if getattr(a, f.name) != getattr(b, f.name)]


def is_secret(name: str) -> bool:
    return any(marker in name.upper() for marker in SECRET_MARKERS)


def import_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``environ`` a snapshot's preload gets from a pod (and its key covers): those
    an import may read, less secrets and per-process values. Pure."""
    return {
        name: value
        for name, value in environ.items()
        if (name in IMPORT_ENV_NAMES or name.startswith(IMPORT_ENV_PREFIXES))
        and not is_secret(name)
        and name not in VOLATILE_NAMES
    }


def code_path_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``environ`` that choose which code runs. Pure."""
    return {name: environ[name] for name in CODE_PATH_NAMES if name in environ}


def env_identity(environ: Mapping[str, str]) -> str:
    """The key's ``env``: the import variables and the code-path ones of ``environ``. Pure."""
    chosen = {**import_env(environ), **code_path_env(environ)}
    return _sha256(json.dumps(chosen, sort_keys=True).encode())


def model_identity(config_json: bytes) -> str:
    """The key's ``model``: what preload imports for this config.json (server/preload.py picks the
    modelling module from model_type and architectures) and the bytes themselves. Pure."""
    try:
        config = json.loads(config_json)
    except ValueError:
        config = None
    config = config if isinstance(config, dict) else {}
    model_type = config.get("model_type")
    architectures = config.get("architectures")
    archs = (
        ",".join(a for a in architectures if isinstance(a, str)) if isinstance(architectures, list) else ""
    )
    kind = kind_of(model_type)
    return (
        f"{kind.value} {model_type if isinstance(model_type, str) else '-'} {archs or '-'} "
        + _sha256(config_json)[:16]
    )


def cpu_identity(cpuinfo: str) -> str:
    """The key's ``cpu`` from /proc/cpuinfo's text: its first ``flags`` line, sorted. Pure."""
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            return _sha256(" ".join(sorted(value.split())).encode())
    return _sha256(b"")


def file_identity(paths: Iterable[Path], root: Path | None = None) -> str:
    """sha256 over each file's path (relative to ``root`` when given), size and mtime; missing files
    count as such."""
    h = hashlib.sha256()
    for path in sorted(paths):
        try:
            st = path.stat()
            fact = f"{st.st_size}:{st.st_mtime_ns}"
        except OSError:
            fact = "missing"
        name = str(path.relative_to(root)) if root is not None else str(path)
        h.update(f"{name}\0{fact}\n".encode())
    return h.hexdigest()


def packages_identity(search_path: Iterable[str]) -> str:
    """The key's ``packages``: every ``*.dist-info/RECORD`` on ``search_path``."""
    records: list[Path] = []
    for entry in dict.fromkeys(search_path):
        if entry and os.path.isdir(entry):
            records += Path(entry).glob("*.dist-info/RECORD")
    return file_identity(records)


def source_identity() -> str:
    """The key's ``source``: keepwarm's own Python files (the runtime's and the API's)."""
    import keepwarm_api

    files: list[Path] = []
    for package in (keepwarm_runtime, keepwarm_api):
        root = Path(package.__file__).resolve().parent
        files += [p for p in root.rglob("*.py")]
    return file_identity(files)


def python_identity() -> str:
    """The key's ``python``: the interpreter's version, prefix and executable (real path, identity)."""
    exe = Path(os.path.realpath(sys.executable))
    return _sha256(f"{sys.version}\0{sys.prefix}\0".encode() + file_identity([exe]).encode())


def user_identity(uid: int, gid: int, groups: Iterable[int]) -> str:
    return f"{uid}:{gid}:{','.join(str(g) for g in sorted(set(groups)))}"


def preload_device(device: str | None) -> str:
    """The key's ``device``: what the parent preloads for (`keepwarm serve --device`; unset: cpu)."""
    return "cuda" if (device or "cpu").startswith("cuda") else "cpu"


def this_process_user() -> str:
    return user_identity(os.getuid(), os.getgid(), os.getgroups())


def snapshot_key(
    config_json: bytes, environ: Mapping[str, str], criu_version: str, user: str, device: str = "cpu"
) -> SnapshotKey:
    """The key of a snapshot of a parent preloaded for ``config_json`` on ``device`` ("cuda" or "cpu")
    with ``environ`` (its import and code-path variables), as this interpreter and machine would take
    or restore it."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    return SnapshotKey(
        format=FORMAT,
        keepwarm=keepwarm_runtime.__version__,
        packages=packages_identity(sys.path),
        source=source_identity(),
        python=python_identity(),
        model=model_identity(config_json),
        device=device,
        env=env_identity(environ),
        cpu=cpu_identity(cpuinfo),
        kernel=os.uname().release,
        criu=criu_version,
        user=user,
    )


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
