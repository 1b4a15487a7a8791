"""The stages reach the apps only through the contract: no generic module names an app.

Checked on the source of every module under src/converge outside src/converge/apps:
no import of ``converge.apps.<name>`` (absolute or relative), no string that names one
(an ``importlib`` or entry-point path), and no comparison of a value with an app's name
(``if app.name == "chem"``). The contract module imports no stage.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import converge
from converge.contract import available_apps

SRC = Path(converge.__file__).parent
APP_NAMES = {"gw", "chem"} | set(available_apps())
STAGES = ("simulate", "train", "serve", "validate", "bench", "demo", "cli")
APP_PATH = re.compile(r"\bapps\.(\w+)")


def generic_modules() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if "apps" not in p.relative_to(SRC).parts)


def app_references(path: Path) -> list[str]:
    """Every place in ``path`` that imports, names or compares against an app, as 'line: what'."""
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(("converge", *path.relative_to(SRC).with_suffix("").parts[:-1]))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            targets = [module] + [f"{module}.{a.name}" for a in node.names]
            if any(APP_PATH.search(t) and APP_PATH.search(t).group(1) in APP_NAMES for t in targets):
                found.append(f"{node.lineno}: from {'.' * node.level}{node.module or ''} import ...")
        elif isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if APP_PATH.search(a.name)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = APP_PATH.search(node.value)
            if match and match.group(1) in APP_NAMES and "\n" not in node.value:
                found.append(f"{node.lineno}: string {node.value!r}")
        elif isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                if isinstance(side, ast.Constant) and side.value in APP_NAMES:
                    found.append(f"{node.lineno}: compares with {side.value!r}")
                if isinstance(side, (ast.Tuple, ast.List, ast.Set)):
                    found += [f"{node.lineno}: compares with {e.value!r}" for e in side.elts
                              if isinstance(e, ast.Constant) and e.value in APP_NAMES]
    return found


@pytest.mark.parametrize("path", generic_modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_generic_module_names_no_app(path):
    assert app_references(path) == [], f"{path.relative_to(SRC)} reaches an app directly: add an App method"


def test_no_generic_docstring_names_an_app_module():
    for path in generic_modules():
        hits = [m.group(0) for m in APP_PATH.finditer(path.read_text()) if m.group(1) in APP_NAMES]
        assert hits == [], f"{path.relative_to(SRC)} names {hits}"


def test_the_contract_imports_no_stage():
    tree = ast.parse((SRC / "contract.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level}
    assert not {m for m in imported if m and m.split(".")[0] in STAGES}, imported


def test_the_checker_finds_what_it_forbids(tmp_path):
    """It fails on each kind of reference (a checker that cannot fail checks nothing)."""
    bad = SRC / "bench" / "_layer_probe_tmp.py"
    bad.write_text('from ..apps.gw.detect import detect_file\nimport converge.apps.chem\n'
                   'X = "converge.apps.gw.learning:GWLearning"\n'
                   'def f(app):\n    if app.name == "chem":\n        return 1\n    return app.name in ("gw", "x")\n')
    try:
        found = app_references(bad)
    finally:
        bad.unlink()
    assert [f.split(":")[0] for f in found] == ["1", "2", "3", "5", "7"], found
