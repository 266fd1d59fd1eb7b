"""Each shared value set is defined once, in keepwarm_api/values.py: read from the source, so a second
hand-written list of dtype names, tiers, cache modes or quantizations in the packages fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from keepwarm_api.values import SERVING_DTYPES, CacheMode, Quantization, Tier

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("api/keepwarm_api", "runtime/keepwarm_runtime", "operator/keepwarm_operator", "bench")
HOME = REPO / "api/keepwarm_api/values.py"

# name -> (strings that make a literal collection a second definition when it holds `least` of them)
VALUE_SETS = {
    "dtype names": (frozenset(SERVING_DTYPES), 2),
    "tiers": (frozenset(t.value for t in Tier), 2),
    "cache modes": (frozenset(m.value for m in CacheMode), 2),
    "quantizations": (frozenset(q.value for q in Quantization), 2),
}


def _docstrings(tree: ast.AST) -> set[int]:
    nodes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, nodes) and node.body and isinstance(node.body[0], ast.Expr)
    }


def second_definitions(source: str) -> list[str]:
    """Literal tuples, lists, sets and dict keys in ``source`` that spell out one of VALUE_SETS, and
    the string "zero_copy" outside docstrings, as "line: what"."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        items = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)
        if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)) and items:
            strings = {i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)}
            for name, (values, least) in VALUE_SETS.items():
                if len(strings & values) >= least:
                    found.append(f"{node.lineno}: {name} {sorted(strings & values)}")
        elif isinstance(node, ast.Constant) and node.value == CacheMode.ZERO_COPY and id(node) not in docs:
            found.append(f"{node.lineno}: cache mode 'zero_copy'")
    return found


def test_the_check_finds_a_second_definition() -> None:
    source = '"""zero_copy is fine here."""\nX = ("float32", "bfloat16")\nY = {"gpu": 1, "host": 2}\n'
    source += 'Z = "zero_copy"\n'
    assert second_definitions(source) == [
        "2: dtype names ['bfloat16', 'float32']",
        "3: tiers ['gpu', 'host']",
        "4: cache mode 'zero_copy'",
    ]


@pytest.mark.parametrize("package", PACKAGES)
def test_value_sets_are_defined_once(package: str) -> None:
    offenders = [
        f"{path.relative_to(REPO)}:{line}"
        for path in sorted((REPO / package).rglob("*.py"))
        if path != HOME
        for line in second_definitions(path.read_text())
    ]
    assert offenders == [], "import these from keepwarm_api.values instead"


def test_the_home_needs_no_pydantic() -> None:
    """The cache daemon and the engine import it on machines without pydantic."""
    import subprocess
    import sys

    code = "import sys, keepwarm_api.values; sys.exit('pydantic' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
