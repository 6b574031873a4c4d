"""Crafted count views that break a bound, through every command that reads them.

A producer's verify record with a request carrying 2**63 - 1 draft tokens, or 10**8 accepted
of 10**8, and a target record with 2**63 - 1 scheduled tokens: the checks name the step
(``views_in_bounds``); ``diff`` and ``export --html`` refuse counts they cannot count (one
line naming the file and step, exit 2) and report a malformed schedule as the first divergence
whichever side it is on; ``explain`` still diagnoses and notes that acceptance could not be
counted, and the Workbench's acceptance panel says why it is empty. Never a traceback, and
never memory or time that grows with the crafted value (found by a held-out fuzz pass: ``diff``
with the damaged run first and ``export --html`` raised OverflowError).
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pytest

from hostile import rewrite
from pcpviz.analysis.acceptance import acceptance, acceptance_from_records
from pcpviz.cli import main as cli_main
from pcpviz.views import figures as fg

ROOT = Path(__file__).resolve().parents[2]
CPU_TRACE = ROOT / "data" / "traces" / "cpu-pcp2-mtp2"
STEP = 3


def run_cli(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli_main(argv)
    return rc, out.getvalue(), err.getvalue()


def _crafted(dst: Path, phase: str, values: dict[str, int]) -> Path:
    def edit(step, rank, phases):
        if step == STEP and rank == 0 and phase in phases:
            for view, v in values.items():
                a = np.asarray(phases[phase][view]).astype(np.int64).copy()
                a[0] = v
                phases[phase][view] = a
    return rewrite(CPU_TRACE, dst, edit)


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("malformed")
    return {
        "huge drafts": _crafted(d / "drafts", "verify", {"num_draft_tokens": 2**63 - 1}),
        "wide acceptance": _crafted(d / "wide", "verify", {"num_draft_tokens": 10**8, "num_accepted": 10**8}),
        "huge scheduled": _crafted(d / "sched", "target", {"num_scheduled_tokens": 2**63 - 1}),
    }


def test_acceptance_refuses_more_draft_tokens_than_k(traces):
    with pytest.raises(ValueError, match=rf"rank0\.arrow: step {STEP}: verify: .*carries 100000000 draft "
                                         r"tokens, more than K = 2"):
        acceptance(traces["wide acceptance"])
    rec = {"num_accepted": np.array([70]), "num_draft_tokens": np.array([70]), "req_ids": np.array(["a"])}
    with pytest.raises(ValueError, match="more than the bound 64"):  # K unknown: the run.json bound
        acceptance_from_records([(0, rec)])
    assert acceptance(traces["wide acceptance"], rank=1).num_draft_tokens == acceptance(CPU_TRACE).num_draft_tokens


@pytest.mark.parametrize("name", ["huge drafts", "wide acceptance", "huge scheduled"])
def test_check_names_the_step(traces, name):
    rc, out, err = run_cli(["check", str(traces[name])])
    assert rc == 1 and not err
    assert f"step {STEP}, rank 0" in out
    assert ("FAIL  views_in_bounds" in out) == (name != "wide acceptance")


@pytest.mark.parametrize("name", ["huge drafts", "wide acceptance", "huge scheduled"])
@pytest.mark.parametrize("damaged_first", [True, False])
def test_diff_on_either_side(traces, name, damaged_first):
    pair = [str(traces[name]), str(CPU_TRACE)] if damaged_first else [str(CPU_TRACE), str(traces[name])]
    rc, out, err = run_cli(["diff", *pair])
    if name != "huge scheduled":  # counts it cannot count: one line naming the file and step
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and f"rank0.arrow: step {STEP}: verify:" in lines[0], lines
        assert "more than K = 2" in lines[0]
        return
    assert rc == 1 and not err, err
    side = "a" if damaged_first else "b"
    first = next(line for line in out.splitlines() if "first divergence" in line)
    assert f"step {STEP}, rank 0: run {side} rank 0: malformed views" in first
    assert "batched the requests differently" not in out  # a malformed step is not another schedule


def test_explain_still_diagnoses_and_says_acceptance_was_not_counted(traces):
    rc, out, err = run_cli(["explain", "--no-rerun", str(traces["huge drafts"])])
    assert rc == 1 and not err, err
    assert f"first wrong view: step {STEP}, rank 0, phase verify, view num_draft_tokens" in out
    assert "note: acceptance: could not evaluate" in out and "more than K = 2" in out
    assert "per rank:" not in out  # not "ranks verify different acceptance": nothing was counted


def test_the_workbench_panel_says_why_it_is_empty_and_the_exports_answer_in_one_line(traces, tmp_path):
    t = traces["huge drafts"]
    stats = fg.load_acceptance(t)
    assert stats.num_drafts == 0 and f"step {STEP}: verify" in stats.note
    title = fg.acceptance_spec(stats)["layout"]["title"]["text"]
    assert title.startswith("acceptance: not counted: ") and "more than K = 2" in title
    assert all(y is None for tr in fg.acceptance_spec(stats)["data"] for y in tr["y"])  # no bar drawn
    rc, out, err = run_cli(["export", str(t), "--html", str(tmp_path / "r.html")])
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and f"step {STEP}: verify:" in lines[0] and not (tmp_path / "r.html").exists()
    rc, out, err = run_cli(["export", str(t), "--chrome", str(tmp_path / "t.json")])
    assert rc == 0 and not err, err
    json.loads((tmp_path / "t.json").read_text())
