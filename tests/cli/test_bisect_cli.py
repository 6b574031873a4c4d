"""``pcpviz bisect``'s ladder and bad input (no producer runs here)."""

from __future__ import annotations

import pytest

from pcpviz.bisect import ladder
from pcpviz.cli.commands import main


def test_the_ladder_changes_one_knob_per_rung():
    rungs, unavailable = ladder("replay", {"pcp": 2, "k": 2, "graph_mode": "PIECEWISE"})
    assert [r.name for r in rungs] == ["pcp=1", "graph_mode=NONE", "graph_mode=FULL_AND_PIECEWISE", "k=1",
                                       "chunked_prefill=False", "decodes=replicated"]
    base = rungs[0].options
    for r in rungs:
        changed = {k for k in base if r.options[k] != base[k]} - {"pcp"}
        assert changed <= {r.knob}
    assert any(u.startswith("prefix_caching") for u in unavailable)
    rungs, unavailable = ladder("engine", {"max_num_batched_tokens": 16}, ["max_num_batched_tokens", "graph_mode"])
    assert [r.name for r in rungs] == ["max_num_batched_tokens=2048"]
    assert unavailable == ["graph_mode (no switch in the engine)"]


@pytest.mark.parametrize("argv, message", [
    (["bisect", "--out", "x", "--knobs", "nope"], "unknown knob 'nope'"),
    (["bisect", "--out", "x", "--producer", "engine", "--graph-mode", "PIECEWISE"], "--graph-mode is a replay knob"),
])
def test_bad_input_is_one_line_exit_2(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
