"""Every view name a check reads is declared in the schema (``VIEW_SPECS``): a misspelled name
fails here for pcpviz's own checks (every function of the check modules, helpers included) and at
registration for a check registered elsewhere (``@check`` validates the function), instead of
making the check skip on every step."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pcpviz.analysis.checks.context import check
from pcpviz.analysis.checks.declared import function_views_read, undeclared_views_read

CHECKS_DIR = Path(__file__).resolve().parents[2] / "pcpviz" / "analysis" / "checks"


def _functions():
    for p in sorted(CHECKS_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef):
                yield f"{p.name}::{node.name}", node


def test_every_view_a_check_module_reads_is_declared():
    read = {name: function_views_read(fn) for name, fn in _functions()}
    assert sum(map(len, read.values())) > 100  # the scan sees the checks' reads
    bad = [f"{name}: {line}" for name, fn in _functions() for line in undeclared_views_read(fn)]
    assert not bad, "\n".join(bad)


def test_pcpviz_own_checks_are_not_parsed_at_import(monkeypatch):
    import pcpviz.analysis.checks.context as context

    parsed = []
    monkeypatch.setattr(context, "validate_check", lambda name, fn: parsed.append(name))

    def own(c):
        c.need("verify", "num_acceptd")
    own.__module__ = "pcpviz.analysis.checks.step_checks"
    context.check("own", "held by the test above, not at import")(own)
    context.DEFS.pop()
    assert parsed == []


def test_a_misspelled_view_fails_at_registration():
    with pytest.raises(ValueError, match=r"check 'k': c\.need\('verify', 'num_acceptd'\).*no view 'num_acceptd'"):
        @check("k", "a planted misspelling")
        def k(c):
            c.need("verify", "num_acceptd")
    with pytest.raises(ValueError, match=r"p\.t\('positons'\)"):
        @check("k2", "a misspelling on the previous step's context")
        def k2(c):
            p = c.prev()
            p.t("positons")
    with pytest.raises(ValueError, match="not declared for phase 'verify'"):
        @check("k3", "a view of another phase")
        def k3(c):
            c.get("verify", "block_table_global")
