"""The file:line citations of pcpviz.analysis.derived_rules and pcpviz.analysis.producers held
against the installed vLLM 0.33.0 source (and this checkout's engine)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from pcpviz.analysis.checks import CHECKS
from pcpviz.analysis.derived_rules import DERIVED_RULES

_SPEC = importlib.util.find_spec("vllm")  # the installed package's source, without importing it (slow)
if _SPEC is None or _SPEC.origin is None:
    pytest.skip("vLLM 0.33.0 is not installed", allow_module_level=True)
VLLM = Path(_SPEC.origin).resolve().parent


@pytest.mark.parametrize("rule", DERIVED_RULES, ids=lambda r: r.check)
def test_derived_rules_cite_vllms_source(rule):
    assert rule.check in CHECKS
    for file, line, name in rule.vllm:
        text = (VLLM / file).read_text().splitlines()
        assert name in text[line - 1], f"{file}:{line} does not hold {name!r}: {text[line - 1]!r}"
