"""The one fault registry (``pcpviz.faults``) agrees with every place that uses it.

A fault added in one place but not the others fails here: each fault names a real check; each
fault a producer declares has a switch in that producer's code and each switch there is declared;
every engine fault has an explain rule (and only those); every synthetic fault, injected, makes
its ``caught_by`` check fail. The engine's own end-to-end run of each fault is tests/analysis/test_faults.py.
"""

from __future__ import annotations

import doctest
import re
from pathlib import Path

import pytest

from pcpviz import faults as F
from pcpviz.analysis.checks import CHECKS, run_checks
from pcpviz.analysis.explain.rules import RULES, UNSEEN
from tracegen import RequestSpec, clean_run, generate

ROOT = Path(__file__).resolve().parents[2]
CONSTANTS = {v: k for k, v in vars(F).items() if k.isupper() and isinstance(v, str) and v in F.FAULTS}


def test_every_fault_is_declared_completely():
    assert set(CONSTANTS) == set(F.FAULTS), "each fault has its constant (the name read at the switch)"
    for name, f in F.FAULTS.items():
        assert CONSTANTS[name] == name.upper()
        assert f.summary and f.caught_by in CHECKS, name
        assert f.producers and f.producers <= set(F.PRODUCERS), name
        if F.ENGINE in f.producers:  # explain weighs these: what it models, where, its signature
            assert f.where and f.models and f.source and f.signature, name
        assert f.faithful or f.summary.startswith("ILLUSTRATION"), name


def test_every_engine_fault_has_an_explain_rule_and_only_those():
    assert set(RULES) == set(F.faults_of(F.ENGINE))
    assert set(UNSEEN) <= set(RULES)


def _switches(producer: str) -> set[str]:
    """The fault names read (as ``F.CONSTANT`` / ``faults.CONSTANT``) in a producer's modules."""
    names = set()
    for rel in F.PRODUCER_MODULES[producer]:
        path = ROOT / rel
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            for const in re.findall(r"\b(?:F|faults)\.([A-Z][A-Z0-9_]+)\b", file.read_text()):
                value = getattr(F, const, None)
                if value in F.FAULTS:
                    names.add(value)
    return names


@pytest.mark.parametrize("producer", F.PRODUCERS)
def test_each_producer_switches_exactly_the_faults_it_declares(producer):
    declared = set(F.faults_of(producer))
    switched = _switches(producer)
    assert switched - declared == set(), f"{producer} reads faults it does not declare"
    assert declared - switched == set(), f"{producer} declares faults it has no switch for"


SYNTHETIC_SETTINGS = (  # the fault-free settings a synthetic fault is tried in
    dict(),
    dict(shard_decode_requests=False),
    dict(requests=[RequestSpec("x", 6, 6), RequestSpec("y", 7, 6), RequestSpec("z", 30, 5, 1)]),
)


@pytest.mark.parametrize("name", sorted(F.faults_of(F.SYNTHETIC)))
def test_each_synthetic_fault_is_injectable_and_caught_by_its_check(name, tmp_path):
    caught_by = F.FAULTS[name].caught_by
    failed = [run_checks(clean_run(2, faults=[name], **kw).write(tmp_path / str(i))).failed
              for i, kw in enumerate(SYNTHETIC_SETTINGS)]
    assert any(caught_by in f for f in failed), f"{name}: {caught_by} never failed ({failed})"


def test_producers_refuse_faults_they_cannot_inject():
    with pytest.raises(ValueError, match="the engine producer cannot inject it"):
        F.parse_fault(F.LAYOUT_NO_SWAP)
    with pytest.raises(ValueError, match="the synthetic producer cannot inject it"):
        generate([RequestSpec("a", 5, 3)], faults=[F.DRAFT_SLOT_FROM_SEQ_LEN])
    with pytest.raises(ValueError, match="unknown fault 'nope'"):
        generate([RequestSpec("a", 5, 3)], faults=["nope"])
    with pytest.raises(ValueError, match="unknown producer"):
        F.faults_of("vllm")


def test_synthetic_fault_onset():
    """``NAME@S``: the synthetic trace equals the clean one before step S, and differs after."""
    clean = clean_run(2)
    late = clean_run(2, faults=[f"{F.SKIP_DRAFT_BLOCK_TABLE_GATHER}@3"])
    assert list(late.meta.inject) == [f"{F.SKIP_DRAFT_BLOCK_TABLE_GATHER}@3"]
    for step in clean.step_ids:
        same = (late.views(step, 0, "draft_1")["block_table_draft"] == clean.views(step, 0, "draft_1")[
            "block_table_draft"]).all()
        assert same == (step < 3), step


def test_module_examples():
    result = doctest.testmod(F)
    assert result.attempted >= 4 and result.failed == 0
