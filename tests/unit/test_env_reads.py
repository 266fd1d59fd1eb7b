"""Only the settings layer reads KEEPWARM_* variables and keepwarm_api.podenv's names from the
environment: read from the source, so a module below an entry point that reads one fails here rather
than in review. Entry points resolve their settings (keepwarm_api.settings.resolve) and pass typed
values down; nothing below them looks a variable up.

Two checks over api/, runtime/ and operator/:

* outside SETTINGS_LAYER, no module looks up a KEEPWARM_* or podenv name in an environment mapping
  (``os.environ``, ``os.getenv``, or a mapping named ``environ``): the key is a string literal, an
  attribute of podenv, a name imported from it, or a module constant built from those (``env_name``,
  an f-string, another constant);
* outside SETTINGS_LAYER, a module that touches ``os.environ`` (or getenv, putenv) at all is listed in
  TOUCHES_ENVIRONMENT with why it must, so a key computed at run time, which the first check cannot
  see, still needs a reason written here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from keepwarm_api import podenv
from keepwarm_api.settings import env_name

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("api/keepwarm_api", "runtime/keepwarm_runtime", "operator/keepwarm_operator")
OS_ENVIRONMENT = frozenset({"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"})
PODENV_NAMES = frozenset(v for k, v in vars(podenv).items() if k.isupper() and isinstance(v, str))

# Modules that read the variables: the settings layer, for programs and for callers without settings.
SETTINGS_LAYER = {
    "api/keepwarm_api/settings.py": "resolve(): a flag, else the variable, else the default",
    "runtime/keepwarm_runtime/cache/env.py": "attach()'s variables, for callers without settings",
    "runtime/keepwarm_runtime/audio/settings.py": "KEEPWARM_AUDIO_BACKEND, for load_audio()'s callers "
    "without settings (`keepwarm serve` passes --audio-backend)",
    "runtime/keepwarm_runtime/modelgen/settings.py": "KEEPWARM_CACHE_HOME: modelgen's builders are called "
    "as a library (tests, benchmarks, the demo; `keepwarm make-model` declares no settings)",
}

# Modules outside the settings layer that touch the process environment, and why they must.
TOUCHES_ENVIRONMENT = {
    "runtime/keepwarm_runtime/server/cli.py": "`keepwarm serve`'s entry point: hands os.environ to "
    "resolve(), and sets OPENBLAS_NUM_THREADS for numpy before torch loads it",
    "runtime/keepwarm_runtime/cache/cli.py": "`keepwarm cache`'s entry point: hands os.environ to the "
    "settings layer",
    "runtime/keepwarm_runtime/bench_cli.py": "`keepwarm bench`'s entry point: hands os.environ to resolve()",
    "operator/keepwarm_operator/cli.py": "the operator's entry point: hands os.environ to its settings",
    "runtime/keepwarm_runtime/server/launcher.py": "starts `keepwarm serve` children: hands them this "
    "environment less the serve variables, so the child's settings are its own",
    "runtime/keepwarm_runtime/agent/download.py": "the Hub download child inherits the environment "
    "(huggingface_hub's HF_* variables, proxies, CA bundles)",
    "runtime/keepwarm_runtime/engine/threads.py": "OpenMP reads OMP_NUM_THREADS and its wait policy from "
    "the environment, once, when torch loads it",
    "runtime/keepwarm_runtime/engine/host_memory.py": "glibc's own MALLOC_* variables: a user's win over "
    "keepwarm's choice",
    "runtime/keepwarm_runtime/engine/attention/native.py": "TORCH_EXTENSIONS_DIR: torch's extension "
    "builder's folder, found as the builder finds it",
    "runtime/keepwarm_runtime/snapshot/fresh.py": "a restored parent replaces its whole environment (and "
    "the C environ) with the pod's, handed over by its launcher",
    "runtime/keepwarm_runtime/snapshot/restore.py": "the launcher hands its whole environment to the "
    "parent it restored, and keys the snapshot by the variables imports read",
    "runtime/keepwarm_runtime/snapshot/take.py": "the agent's own code-path variables (PATH, PYTHONPATH, "
    "...) are those of the parent it checkpoints, never a pod's",
}


def _is_os_environment(node: ast.AST) -> bool:
    """``os.environ``, ``os.getenv``, ... (the process environment itself)."""
    return (
        isinstance(node, ast.Attribute)
        and node.attr in OS_ENVIRONMENT
        and isinstance(node.value, ast.Name)
        and node.value.id == "os"
    )


def touches_environment(tree: ast.AST) -> bool:
    """Whether a module uses the process environment at all (``os.environ``, ``from os import getenv``)."""
    for node in ast.walk(tree):
        if _is_os_environment(node):
            return True
        if (
            isinstance(node, ast.ImportFrom)
            and node.module == "os"
            and OS_ENVIRONMENT & {a.name for a in node.names}
        ):
            return True
    return False


class _Keys:
    """What an expression evaluates to when it is a name of an environment variable this module can
    spell without running: literals, podenv's names, env_name() calls and module constants of them."""

    def __init__(self, tree: ast.Module) -> None:
        self.podenv_aliases: set[str] = set()
        self.constants: dict[str, str] = {}
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module == "keepwarm_api":
                self.podenv_aliases |= {a.asname or a.name for a in node.names if a.name == "podenv"}
            elif isinstance(node, ast.ImportFrom) and node.module == "keepwarm_api.podenv":
                for a in node.names:
                    value = getattr(podenv, a.name, None)
                    if isinstance(value, str):
                        self.constants[a.asname or a.name] = value
            elif isinstance(node, ast.Import):
                self.podenv_aliases |= {
                    a.asname for a in node.names if a.name == "keepwarm_api.podenv" and a.asname
                }
            elif isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                value = self.value(node.value)
                for target in targets:
                    if isinstance(target, ast.Name) and value is not None:
                        self.constants[target.id] = value

    def value(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name):
            return self.constants.get(node.id)
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in self.podenv_aliases
        ):
            value = getattr(podenv, node.attr, None)
            return value if isinstance(value, str) else None
        if isinstance(node, ast.JoinedStr) and node.values:  # f"KEEPWARM_{...}": its constant start
            return self.value(node.values[0])
        if isinstance(node, ast.Call) and _called(node.func) == "env_name" and node.args:
            parts = [self.value(arg) for arg in node.args]
            if None not in parts:
                return env_name(*parts)  # type: ignore[arg-type]
        return None


def _called(func: ast.AST) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _is_mapping_of_environment(node: ast.AST) -> bool:
    """``os.environ``, or a mapping named ``environ`` (the settings layer's parameter for it)."""
    if _is_os_environment(node):
        return isinstance(node, ast.Attribute) and node.attr in ("environ", "environb")
    return (isinstance(node, ast.Name) and node.id == "environ") or (
        isinstance(node, ast.Attribute) and node.attr == "environ"
    )


def _looked_up(node: ast.AST) -> ast.AST | None:
    """The key expression when ``node`` reads the environment by key, else None."""
    if isinstance(node, ast.Call) and node.args:
        func = node.func
        if isinstance(func, ast.Attribute):
            if func.attr in ("get", "pop", "setdefault", "__getitem__") and _is_mapping_of_environment(
                func.value
            ):
                return node.args[0]
            if func.attr in ("getenv", "getenvb") and _is_os_environment(func):
                return node.args[0]
        if isinstance(func, ast.Name) and func.id in ("getenv", "getenvb"):
            return node.args[0]
    if isinstance(node, ast.Subscript) and _is_mapping_of_environment(node.value):
        return node.slice
    if (
        isinstance(node, ast.Compare)
        and isinstance(node.ops[0], ast.In | ast.NotIn)
        and _is_mapping_of_environment(node.comparators[0])
    ):
        return node.left
    return None


def keepwarm_reads(source: str) -> list[str]:
    """Each lookup in ``source`` of a KEEPWARM_* or podenv variable in the environment, as "line: NAME"."""
    tree = ast.parse(source)
    keys = _Keys(tree)
    found = []
    for node in ast.walk(tree):
        key = _looked_up(node)
        name = None if key is None else keys.value(key)
        if name is not None and (name.startswith(env_name("")) or name in PODENV_NAMES):
            found.append((node.lineno, name))
    return [f"{line}: {name}" for line, name in sorted(found)]


def _modules() -> list[tuple[str, ast.Module, str]]:
    """(path relative to the repository, tree, source) of every module outside the settings layer."""
    out = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            rel = str(path.relative_to(REPO))
            if rel not in SETTINGS_LAYER:
                source = path.read_text()
                out.append((rel, ast.parse(source), source))
    return out


def test_the_check_finds_every_form_of_a_read() -> None:
    source = "\n".join(
        [
            "import os",
            "from keepwarm_api import podenv",
            "from keepwarm_api.podenv import KERNEL_CACHE as KC",
            "from keepwarm_api.settings import env_name",
            "ROOT = env_name('download_root')",
            "OWN = 'KEEPWARM_' + 'X'",  # not spelled statically: the second check's business
            "a = os.environ.get('KEEPWARM_PORT')",
            "b = os.environ[podenv.NODE_NAME]",
            "c = os.getenv(KC)",
            "d = ROOT in os.environ",
            "def f(environ):",
            "    return environ.get(podenv.POD_NAMESPACE, 'default')",
            "e = os.environ.get(f'KEEPWARM_{OWN}')",
            "g = os.environ.get('OMP_NUM_THREADS')",  # another program's variable: allowed here
            "h = {'KEEPWARM_PORT': 1}.get('KEEPWARM_PORT')",  # not the environment
        ]
    )
    assert keepwarm_reads(source) == [
        "7: KEEPWARM_PORT",
        "8: NODE_NAME",
        "9: KEEPWARM_KERNEL_CACHE",
        "10: KEEPWARM_DOWNLOAD_ROOT",
        "12: POD_NAMESPACE",
        "13: KEEPWARM_",
    ]
    assert touches_environment(ast.parse(source))
    assert touches_environment(ast.parse("from os import getenv\n"))
    assert not touches_environment(ast.parse("import os\nos.path.join('a')\n"))


@pytest.mark.parametrize("package", PACKAGES)
def test_only_the_settings_layer_reads_keepwarm_variables(package: str) -> None:
    offenders = [
        f"{rel}:{read}"
        for rel, _, source in _modules()
        if rel.startswith(package)
        for read in keepwarm_reads(source)
    ]
    assert offenders == [], (
        "resolve it as a setting at the entry point and pass it down (keepwarm_api.settings)"
    )


def test_every_module_that_touches_the_environment_says_why() -> None:
    touching = {rel for rel, tree, _ in _modules() if touches_environment(tree)}
    assert sorted(touching - TOUCHES_ENVIRONMENT.keys()) == [], (
        "read a setting through the settings layer, or say here why this module must read the environment"
    )
    assert sorted(TOUCHES_ENVIRONMENT.keys() - touching) == [], "no longer touches it: drop the exemption"


def test_the_settings_layer_is_where_the_variables_are_read() -> None:
    """The exemptions name real modules that do read the environment (no stale entry)."""
    for rel in SETTINGS_LAYER:
        assert touches_environment(ast.parse((REPO / rel).read_text())), rel
