"""The import direction of the packages, enforced by parsing every module's imports (``ast``; lazy
imports inside functions count too):

    benchmarks -> trainer -> policy, rollout -> common, tq

``tq`` (the data plane) imports none of the others; ``common`` (models, ``BatchedDataDict``, field
names) imports none of the others either; ``rollout`` and ``policy`` are siblings and never import
each other; nothing imports ``benchmarks`` except the tests of a benchmark; no test module imports
another one (shared helpers live in ``tests/conftest.py``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("tq", "common", "rollout", "policy", "trainer", "benchmarks")

# What each package must never import (top-level package names).
FORBIDDEN = {
    "tq": {"common", "rollout", "policy", "trainer", "benchmarks"},
    "common": {"tq", "rollout", "policy", "trainer", "benchmarks"},
    "rollout": {"policy", "trainer", "benchmarks"},
    "policy": {"rollout", "trainer", "benchmarks"},
    "trainer": {"benchmarks"},
}

# A test imports a benchmark module only to test that benchmark: its file name shares a word with the
# module's (test_chaos.py -> benchmarks.tq_chaos). A helper both need lives in the package it describes
# (e.g. ``tq.testing``) or in tests/conftest.py.
_NOT_A_TOPIC = {"test", "bench", "tq", "py"}


def imported_packages(path: Path) -> set[str]:
    """Top-level names of every absolute import in ``path`` (relative imports stay in their package)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def imported_benchmarks(path: Path) -> set[str]:
    """Names of the ``benchmarks`` modules ``path`` imports."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[1] for a in node.names if a.name.startswith("benchmarks."))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "benchmarks":
                out.update(a.name for a in node.names)
            elif node.module.startswith("benchmarks."):
                out.add(node.module.split(".")[1])
    return out


def _topics(name: str) -> set[str]:
    return set(name.removesuffix(".py").split("_")) - _NOT_A_TOPIC


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_packages_import_only_downward(package):
    assert modules(package), f"no modules found under {package}/"
    bad = {str(p.relative_to(ROOT)): sorted(imported_packages(p) & FORBIDDEN[package]) for p in modules(package)}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"{package} must not import {sorted(FORBIDDEN[package])}; found: {bad}"


def test_tests_import_no_other_test_module_and_no_benchmark_they_do_not_test():
    bad = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        others = sorted(n for n in imported_packages(path) if n.startswith("test_"))
        if others:
            bad.append((path.name, others))
        benches = imported_benchmarks(path)
        tested = {b for b in benches if _topics(path.name) & _topics(b)}
        for bench in sorted(benches - tested):
            if bench == "outputs" and tested:  # the benchmarks' run-directory helper, tested with them
                continue
            bad.append((path.name, f"benchmarks.{bench}"))
    assert not bad, f"tests importing other test modules or benchmarks they do not test (use tests/conftest.py): {bad}"


def test_only_the_connection_value_builds_clients():
    """policy, rollout and trainer get a ``TQConnection`` and call ``connect()``; none builds a TQClient."""
    bad = []
    for package in ("common", "rollout", "policy", "trainer"):
        for path in modules(package):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call):
                    f = node.func
                    name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                    if name == "TQClient":
                        bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, f"TQClient built outside tq.TQConnection.connect(): {bad}"


def test_the_checker_sees_imports(tmp_path):
    """The parser finds absolute imports, lazy ones inside functions included, and skips relative ones."""
    src = tmp_path / "m.py"
    src.write_text("import a.b\nfrom c.d import e\nfrom . import f\ndef g():\n    from policy.x import y\n")
    assert imported_packages(src) == {"a", "c", "policy"}
