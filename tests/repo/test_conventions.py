"""The house rules of CONTRIBUTING.md, held by the code itself.

* a module of ``pcpviz/`` stays under ``MAX_MODULE_LINES`` lines;
* a function's code (its docstring aside: worked examples are welcome) under ``MAX_FUNCTION_LINES``;
* no underscore name is imported from another pcpviz module (a module's private names are its own);
* a public function or method takes at most three positional parameters (the rest keyword-only).

``KNOWN`` lists the places that still break a rule, each with its size today: it may only
shrink. A new offender, or a known one that grows, fails with the place and the rule; fixing
one fails too until its line is removed here, so the list stays true.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80
MAX_POSITIONAL = 3

# rule -> {place: size today}
KNOWN: dict[str, dict[str, int]] = {
    "function-lines": {
    },
    "module-lines": {
    },
    "positional-params": {
    },
    "underscore-import": {
    },
}


def _code_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = fn.body
    signature = body[0].lineno - fn.lineno  # the def line(s), up to the first statement
    if isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    if not body:
        return signature
    return signature + body[-1].end_lineno - body[0].lineno + 1


def _public_defs(tree: ast.Module):
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            yield node.name, node
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and not sub.name.startswith("_"):
                    yield f"{node.name}.{sub.name}", sub


def measure(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """Every breach of the rules under ``root/pcpviz``: rule -> {place: size}."""
    out: dict[str, dict[str, int]] = {k: {} for k in KNOWN}
    for p in sorted((root / "pcpviz").rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        src = p.read_text()
        lines = src.count("\n")
        if lines > MAX_MODULE_LINES:
            out["module-lines"][rel] = lines
        tree = ast.parse(src)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = _code_lines(node)
                if n > MAX_FUNCTION_LINES:
                    out["function-lines"][f"{rel}::{node.name}"] = n
            if isinstance(node, ast.ImportFrom) and node.module and (node.module.startswith("pcpviz") or node.level):
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        out["underscore-import"][f"{rel}: {a.name}"] = 1
        for name, fn in _public_defs(tree):
            args = [a.arg for a in fn.args.posonlyargs + fn.args.args if a.arg not in ("self", "cls")]
            if len(args) > MAX_POSITIONAL:
                out["positional-params"][f"{rel}::{name}"] = len(args)
    return out


@pytest.mark.parametrize("rule", sorted(KNOWN))
def test_rule_holds_or_shrinks(rule):
    now = measure()[rule]
    new = {k: v for k, v in now.items() if k not in KNOWN[rule] or v > KNOWN[rule][k]}
    assert not new, f"{rule}: new or grown: " + "; ".join(f"{k} ({v})" for k, v in sorted(new.items()))
    fixed = sorted(set(KNOWN[rule]) - set(now))
    assert not fixed, f"{rule}: fixed, remove from KNOWN: {', '.join(fixed)}"


def test_rules_catch_a_planted_breach(tmp_path):
    """Each rule is live: a planted module breaking all four is reported under each."""
    pkg = tmp_path / "pcpviz"
    pkg.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES + 1))
    (pkg / "bad.py").write_text("from pcpviz.other import _private\n\n\ndef f(a, b, c, d):\n"
                                f'    """doc"""\n{body}\n    return 0\n' + "\n" * MAX_MODULE_LINES)
    got = measure(tmp_path)
    # def + body + return
    assert got["module-lines"] and got["function-lines"] == {"pcpviz/bad.py::f": MAX_FUNCTION_LINES + 3}
    assert got["underscore-import"] == {"pcpviz/bad.py: _private": 1}
    assert got["positional-params"] == {"pcpviz/bad.py::f": 4}
