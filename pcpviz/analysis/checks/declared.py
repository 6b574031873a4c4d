"""View names a check reads, held to the schema: a misspelled view fails at registration.

``check`` (``pcpviz.analysis.checks.context``) passes each decorated function defined outside
pcpviz's check modules here (pcpviz's own are held to it by
``tests/analysis/test_check_views_declared.py``, not at every command's start); every
string literal it hands to its context as a view (``c.t(view)``, ``c.need(phase, view)``,
``c.get``, ``c.expect``, ``c.no_null_block``, ``c.fail``, also on ``c.prev()``) must be a view of
``pcpviz.trace.schema.VIEW_SPECS`` — declared for that phase when the phase is a literal too.
Without the check, a misspelled name would make ``c.need`` skip the check on every step.

PCP=2 example: ``c.need("verify", "num_acceptd")`` in a check named ``k`` raises
``ValueError: check 'k': c.need('verify', 'num_acceptd') (line 3): no view 'num_acceptd' in
pcpviz.trace.schema.VIEW_SPECS``.
"""

from __future__ import annotations

import ast
import inspect
import os
import textwrap
from functools import lru_cache
from pathlib import Path
from typing import Callable

from pcpviz.trace.schema import KNOWN_VIEWS, view_spec

__all__ = ["VIEW_METHODS", "undeclared_views_read", "function_views_read"]

VIEW_METHODS: dict[str, int] = {"t": 0, "need": 1, "get": 1, "expect": 1, "no_null_block": 1, "fail": 1}
"""Context method -> the position of its view argument (the phase, when any, comes before it)."""


def _literal(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def function_views_read(tree: ast.FunctionDef) -> list[tuple[str | None, str, str, int]]:
    """``(phase or None, view, call text, line)`` of each literal view name ``tree`` (a check
    function or a helper taking the context first) reads from its context."""
    if not tree.args.args:
        return []
    ctx = {tree.args.args[0].arg}
    for node in ast.walk(tree):  # p = c.prev(): the previous step's context
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) \
                and isinstance(node.value.func, ast.Attribute) and node.value.func.attr == "prev" \
                and isinstance(node.value.func.value, ast.Name) and node.value.func.value.id in ctx:
            ctx |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in VIEW_METHODS and isinstance(node.func.value, ast.Name)
                and node.func.value.id in ctx):
            continue
        at = VIEW_METHODS[node.func.attr]
        view = _literal(node.args[at]) if len(node.args) > at else None
        if view is None:
            continue
        phase = _literal(node.args[0]) if at else "target"
        shown = ", ".join(repr(a.value) if isinstance(a, ast.Constant) else "…" for a in node.args[:at + 1])
        out.append((phase, view, f"{node.func.value.id}.{node.func.attr}({shown})", node.lineno))
    return out


def undeclared_views_read(tree: ast.FunctionDef) -> list[str]:
    """One line per literal view ``tree`` reads that the schema does not declare (for its
    phase, when the phase is a literal)."""
    bad = []
    for phase, view, call, line in function_views_read(tree):
        if view not in KNOWN_VIEWS:
            bad.append(f"{call} (line {line}): no view {view!r} in pcpviz.trace.schema.VIEW_SPECS")
        elif phase is not None and view_spec(phase, view) is None:
            bad.append(f"{call} (line {line}): view {view!r} is not declared for phase {phase!r}")
    return bad


@lru_cache(maxsize=64)
def _functions_of(filename: str, size: int, mtime_ns: int) -> dict[int, ast.FunctionDef]:
    """Every function of a source file by its first line (its first decorator's, if any): one
    parse a module, not one a check."""
    tree = ast.parse(Path(filename).read_text(encoding="utf-8"))
    return {(node.decorator_list[0].lineno if node.decorator_list else node.lineno): node
            for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _tree(fn: Callable) -> ast.AST | None:
    code = getattr(fn, "__code__", None)
    try:
        st = os.stat(code.co_filename)
        found = _functions_of(code.co_filename, st.st_size, st.st_mtime_ns).get(code.co_firstlineno)
        if found is not None and found.name == fn.__name__:
            return found
    except (AttributeError, OSError, SyntaxError, UnicodeDecodeError, ValueError):
        pass
    try:  # not in a file we can parse (a notebook cell): its own source
        return ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return None


def validate_check(name: str, fn: Callable) -> None:
    """Raise ``ValueError`` naming the check and the call when ``fn`` reads an undeclared view
    (a function whose source cannot be read, e.g. made by ``exec``, is left to the tests)."""
    tree = _tree(fn)
    if isinstance(tree, (ast.FunctionDef, ast.AsyncFunctionDef)):
        bad = undeclared_views_read(tree)
        if bad:
            raise ValueError(f"check {name!r}: {bad[0]}")
