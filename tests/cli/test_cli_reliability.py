"""Issue 39's reliability classes through the command line: damaged values give every command
the same verdict (exit 3, one 'incomplete:' line), products of bounded options are bounded."""

from __future__ import annotations

import contextlib
import io
import time

import numpy as np
import pytest

from pcpviz.cli import main as cli_main
from tracegen import clean_run, corrupt, write


def run_cli(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli_main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module", params=[np.inf, np.nan, 1e300, 2.5], ids=["inf", "nan", "huge", "fraction"])
def damaged(request, tmp_path_factory):
    run = clean_run(2, 2)
    step = run.steps[1][0]
    corrupt(run, step, "target", "seq_lens", lambda a: np.full(a.shape, request.param, dtype="<f8"), ranks=[1])
    return write(run, tmp_path_factory.mktemp("d"))


@pytest.mark.parametrize("argv", [["check", "{t}"], ["export", "{t}", "--html", "{o}.html"],
                                  ["export", "{t}", "--chrome", "{o}.json"], ["explain", "{t}", "--no-rerun"],
                                  ["diff", "{t}", "{t}"]], ids=["check", "html", "chrome", "explain", "diff"])
def test_a_float_in_an_integer_view_is_exit_3_in_every_command(damaged, tmp_path, argv):
    rc, _, err = run_cli([a.format(t=damaged, o=tmp_path / "out") for a in argv])
    assert rc == 3, err
    lines = {line for line in err.strip().splitlines()}
    assert len(lines) == 1 and "rank1.arrow step" in err and "seq_lens holds" in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv, named", [
    (["--pad", "65536", "--pcp", "1024", "--batch", "p13"], "--pcp 1024 x --pad 65536"),
    (["--pcp", "1024", "--batch", ",".join(["d1"] * 4096)], "--pcp 1024 x --batch's 4096 rows"),
])
def test_layout_bounds_products_of_options(argv, named):
    t0 = time.monotonic()
    rc, _, err = run_cli(["layout", *argv])
    assert rc == 2 and named in err and len(err.strip().splitlines()) == 1, err
    assert time.monotonic() - t0 < 10  # refused at once, not after allocating the product


def test_make_lab_turns_off_the_news_pop_up():
    """``make lab`` installs the lab settings overrides the browser tests use (no news, no update
    check) and starts JupyterLab with an empty news URL."""
    import json
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    plan = subprocess.run(["make", "-n", "lab"], cwd=root, capture_output=True,
                          text=True, timeout=60).stdout
    assert "tools/jupyterlab/overrides.json" in plan and "share/jupyter/lab/settings/overrides.json" in plan
    assert "--LabApp.news_url=" in plan
    doc = json.loads((root / "tools/jupyterlab/overrides.json").read_text())
    assert doc["@jupyterlab/apputils-extension:notification"] == {"fetchNews": "false", "checkForUpdates": False}


def test_open_warns_on_a_live_run_before_its_first_step(tmp_path):
    """``pcpviz.trace.open`` on a run whose writer holds the directory but has not finished a
    step: a TraceWarning naming the directory (and the writer), not a silent empty trace; with
    ``strict`` a TraceError; ``pcpviz check`` exits 3 on the same directory."""
    import warnings

    import pcpviz.trace as pt

    run = tmp_path / "live"
    with pt.claim(run, command="test writer") as c:
        w = pt.TraceWriter(run, 0, meta=clean_run(1, 1).meta, owner=c.token)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                t = pt.open(run)
            assert not t.steps
            lines = [str(x.message) for x in caught if issubclass(x.category, pt.TraceWarning)]
            assert any("no complete step yet" in ln and "test writer" in ln for ln in lines), lines
            with pytest.raises(pt.TraceError, match="no complete step yet"):
                pt.open(run, strict=True)
            rc, _, err = run_cli(["check", run])
            assert rc == 3, err
        finally:
            w.close()


@pytest.mark.slow  # a 128k-token step written and checked
def test_synth_writes_a_128k_token_step(tmp_path):
    """``pcpviz synth``: the synthetic producer's 128k-token step from the command line, checked
    clean; a second write into the same directory is refused without --overwrite."""
    import pcpviz.trace as pt

    out = tmp_path / "s"
    rc, stdout, err = run_cli(["synth", "--tokens", "131072", "--requests", "16", "--pcp", "4", "--trace", out])
    assert rc == 0, err
    t = pt.open(out)
    first = t.record(t.steps[0], 0, "target")
    assert int(np.asarray(first["num_scheduled_tokens"]).sum()) == 131072 and len(first["req_ids"]) == 16
    assert run_cli(["check", out])[0] == 0
    rc, _, err = run_cli(["synth", "--trace", out])
    assert rc == 2 and "--overwrite" in err


def test_run_takes_max_num_seqs(tmp_path):
    """``--max-num-seqs`` reaches the rank config, so 64 requests can share one step."""
    import json

    cfg = tmp_path / "ranks.json"
    rc, _, err = run_cli(["run", "--max-num-seqs", "64", *sum((["--prompt", f"p{i}"] for i in range(64)), []),
                          "--write-config", cfg])
    assert rc == 0, err
    assert json.loads(cfg.read_text())["max_num_seqs"] == 64
    assert run_cli(["run", "--max-num-seqs", "0", "--prompt", "x"])[0] == 2


def test_a_rank_timeout_names_the_option():
    from pcpviz.engine.launch import RankError, timeout_named

    err = timeout_named(RankError(1, "Gloo: Timed out waiting 5000ms for recv"), 5.0)
    assert "rank 1 failed" in str(err) and "--timeout" in str(err) and "5 s" in str(err) and err.rank == 1
    other = RankError(0, "out of memory")
    assert timeout_named(other, 5.0) is other


def test_notebook_06_fault_sweep_says_what_it_runs_first():
    """Notebook 06's fault sweep (minutes of engine runs) prints what follows before its first run
    and flushes a row as each run ends."""
    import json
    from pathlib import Path

    nb = json.loads((Path(__file__).resolve().parents[2] / "notebooks/06_design_review.ipynb").read_text())
    cell = next("".join(c["source"]) for c in nb["cells"] if "faults_of(ENGINE)" in "".join(c["source"]))
    first_run = cell.index("pcpviz.run(")
    assert "engine runs of 2 ranks follow" in cell[:first_run]
    assert cell.count("flush=True") >= 3
