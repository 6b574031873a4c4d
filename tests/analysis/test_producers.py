"""The file:line citations of pcpviz.analysis.derived_rules and pcpviz.analysis.producers held
against the installed vLLM 0.33.0 source (and this checkout's engine)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from pcpviz.analysis.checks import CHECKS
from pcpviz.analysis.derived_rules import DERIVED_RULES

_SPEC = importlib.util.find_spec("vllm")  # the installed package's source, without importing it (slow)
if _SPEC is None or _SPEC.origin is None:
    pytest.skip("vLLM 0.33.0 is not installed", allow_module_level=True)
VLLM_ROOT = Path(_SPEC.origin).resolve().parent


@pytest.mark.parametrize("rule", DERIVED_RULES, ids=lambda r: r.check)
def test_derived_rules_cite_vllms_source(rule):
    assert rule.check in CHECKS
    for file, line, name in rule.vllm:
        text = (VLLM_ROOT / file).read_text().splitlines()
        assert name in text[line - 1], f"{file}:{line} does not hold {name!r}: {text[line - 1]!r}"


# --------------------------------------------------------------------------- the producer map

import ast  # noqa: E402

from tracegen import corrupt, worked_example_run  # noqa: E402

from pcpviz.analysis.checks import run_checks  # noqa: E402
from pcpviz.cli.commands import main as cli_main  # noqa: E402
from pcpviz.analysis.producers import ENGINE_PRODUCERS, INSIDE, VLLM, attribute, attribute_violation, find_def  # noqa: E402
from pcpviz.trace import open as open_trace  # noqa: E402
from pcpviz.trace.schema import VIEW_SPECS  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
_DECLARED = {(ph, s.name) for s in VIEW_SPECS for ph in s.phases}


def _names(node: ast.AST) -> set[str]:
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.arg):
            out.add(n.arg)
    return out


def _declared(key: str) -> bool:
    phase, view = key.split(".", 1)
    if phase.startswith("prev_") and phase != "prev_verify":  # the previous step's phase
        phase = phase[5:]
    cls = {"draft_1": "draft_k", "draft_prev": "draft_k", "prev_verify": "verify"}.get(phase, phase)
    return (cls, view) in _DECLARED or (phase == "draft_prev" and ("draft_0", view) in _DECLARED)


@pytest.mark.parametrize("p", VLLM, ids=lambda p: f"{p.name}:{p.writes[0]}")
def test_vllm_producers_exist_at_their_line_and_read_their_inputs(p):
    tree = ast.parse((VLLM_ROOT / p.where).read_text())
    node = find_def(tree, p.name)
    assert node is not None, f"vllm/{p.where} has no {p.name}"
    assert node.lineno == p.line, f"{p.name} is defined at vllm/{p.where}:{node.lineno}, the map says {p.line}"
    missing = set(p.reads) - _names(node)
    assert not missing, f"{p.name} reads no {sorted(missing)}"
    assert all(_declared(k) for k in p.writes + p.inputs), [k for k in p.writes + p.inputs if not _declared(k)]


@pytest.mark.parametrize("p", ENGINE_PRODUCERS, ids=lambda p: f"{p.name}:{p.writes[0]}")
def test_engine_producers_exist_and_read_their_inputs(p):
    module, qual = p.where.split(":")
    node = find_def(ast.parse((ROOT / ("/".join(module.split(".")) + ".py")).read_text()), qual)
    assert node is not None, f"{p.where} does not exist"
    assert p.cite().endswith(f":{node.lineno}")
    missing = set(p.reads) - _names(node)
    assert not missing, f"{p.name} reads no {sorted(missing)}"
    assert all(_declared(k) for k in p.writes + p.inputs), [k for k in p.writes + p.inputs if not _declared(k)]



def test_the_first_wrong_value_is_walked_up_to_the_producer_whose_inputs_were_right():
    producer = "vllm-plugin"
    a = attribute(producer, "draft_1", "draft_seq_lens", recorded=lambda k: True, wrong=lambda k: False, compared=True)
    assert (a.producer, a.verdict) == ("prepare_decode_inputs", INSIDE)
    assert a.cite == "vllm/v1/worker/gpu/spec_decode/target_dependent_ar/speculator.py:862"
    assert "target.seq_lens" in a.inputs_right and "verify.num_rejected" in a.inputs_right and "sure" in a.sure
    b = attribute(producer, "draft_1", "slot_mapping_draft", recorded=lambda k: True,
                  wrong=lambda k: k == "draft_1.draft_positions", compared=False)
    assert b.chain == ("BlockTables.compute_slot_mappings", "prepare_decode_inputs")
    assert b.view == "draft_1.draft_positions"
    none = attribute("pcpviz-synthetic", "target", "positions", recorded=lambda k: True,
                     wrong=lambda k: False, compared=False)
    assert none.producer is None and "no producer map" in none.sure
    missing = attribute(producer, "target", "seq_lens", recorded=lambda k: k != "target.query_start_loc",
                        wrong=lambda k: False, compared=True)
    assert "target.query_start_loc" in missing.inputs_missing and missing.sure.startswith("likely")


def test_check_names_the_producer_of_a_planted_wrong_draft_position(tmp_path):
    run = worked_example_run()  # producer vllm-replay: the vLLM map
    corrupt(run, 7, "draft_1", "draft_positions", lambda a: a + 1)
    path = run.write(tmp_path / "t")
    who = attribute_violation(open_trace(path), run_checks(path))
    assert who.view == "draft_1.draft_positions" and who.producer == "prepare_decode_inputs"
    assert "walked up from BlockTables.compute_slot_mappings" in who.line() and "the fault is inside it" in who.line()


def test_check_diff_and_explain_print_the_producer(tmp_path, capsys):
    """The human line and the additive --json key ``producer`` (null where nothing failed)."""
    run = worked_example_run()
    good = run.write(tmp_path / "good")
    corrupt(run, 7, "draft_1", "draft_positions", lambda a: a + 1)
    bad = run.write(tmp_path / "bad")
    assert cli_main(["check", str(bad)]) == 1
    assert "first wrong value: draft_1.draft_positions written by `prepare_decode_inputs`" in capsys.readouterr().out
    assert cli_main(["check", "--json", str(bad)]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["producer"]["producer"] == "prepare_decode_inputs" and "checks" in doc
    assert cli_main(["check", "--json", str(good)]) == 0
    assert json.loads(capsys.readouterr().out)["producer"] is None
    assert cli_main(["diff", "--json", str(good), str(bad)]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["producer"]["view"].startswith("draft_1.") and d["producer"]["producer"] is not None
    assert cli_main(["explain", "--json", "--no-rerun", str(bad), str(good)]) == 1
    assert json.loads(capsys.readouterr().out)["producer"]["producer"] == "prepare_decode_inputs"
