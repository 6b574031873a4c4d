"""pcpviz.trace.validate: run.json's schema, run.json against the data, completeness; and the
same status in run_checks, the HTML export and the Workbench."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest

import pcpviz.trace as pt
from pcpviz.analysis.checks import run_checks

ROOT = Path(__file__).resolve().parents[2]
CPU_TRACE = ROOT / "data" / "traces" / "cpu-pcp2-mtp2"


@pytest.fixture()
def trace_dir(tmp_path):
    d = tmp_path / "t"
    shutil.copytree(CPU_TRACE, d)
    return d


def _set(d: Path, **changes):
    meta = json.loads((d / "run.json").read_text())
    for k, v in changes.items():
        if v is ...:
            meta.pop(k)
        else:
            meta[k] = v
    (d / "run.json").write_text(json.dumps(meta))


def _status(d: Path) -> pt.TraceStatus:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # open's warnings are among the status lines
        return pt.validate(pt.open(d))


@pytest.mark.parametrize("changes, key, text", [
    (dict(pcp="2"), "pcp", "expected an int in 1..4096, got str '2'"),
    (dict(block_size=0), "block_size", "expected an int in 1..1048576, got 0"),
    (dict(block_size=..., ), "block_size", "required key is missing"),
    (dict(dcp=2 ** 63), "dcp", "expected an int in 1..4096"),
    (dict(producer=...), "producer", "required key is missing"),
    (dict(num_speculative_tokens=3), "num_speculative_tokens", "draft_1"),
    (dict(num_speculative_tokens=0), "num_speculative_tokens", "K=2"),
    (dict(num_speculative_tokens=...), "num_speculative_tokens", "missing, but step 0 rank 0 records draft_1"),
    (dict(block_size=32), "block_size", "fit block size 16"),
    (dict(pcp=1), "pcp", "also holds rank1.arrow"),
    (dict(shard_decode_requests="yes"), "shard_decode_requests", "expected true or false"),
    (dict(prompt_token_ids=[[1, 2, 3]]), "prompt_token_ids", "request req0's prompt has token 1"),
    (dict(num_steps=12), "num_steps", "12, but the rank files hold 13 steps"),
])
def test_invalid_run_json_is_one_line_naming_file_and_key(trace_dir, changes, key, text):
    _set(trace_dir, **changes)
    st = _status(trace_dir)
    bad = [p for p in st.problems if p.kind == pt.INVALID]
    assert not st.valid and bad[0].key == key and text in bad[0].message, st.lines()
    assert bad[0].message.startswith(f"{trace_dir / 'run.json'}: {key}: ") and "\n" not in bad[0].message


def test_unknown_keys_are_allowed(trace_dir):
    _set(trace_dir, gpu_names=["NVIDIA H200"] * 2, torch_version="2.9.0", command="pcpviz run ...",
         vllm_version="0.33.0")
    assert _status(trace_dir).ok


@pytest.mark.parametrize("damage, text", [
    ("delete", "rank1.arrow: missing (run.json says pcp=2)"),
    ("directory", "rank1.arrow: cannot read (a directory, not a file)"),
    ("/dev/zero", "rank1.arrow: cannot read (a device, not a regular file"),
    ("truncate", "last complete step: step 11"),
    ("num_steps", "num_steps: 20, but the rank files hold 13 steps"),
    ("empty", "rank1.arrow: empty file (the writer died before writing its schema header)"),
])
def test_incomplete_trace(trace_dir, damage, text):
    f = trace_dir / "rank1.arrow"
    if damage == "delete":
        f.unlink()
    elif damage == "directory":
        f.unlink()
        f.mkdir()
    elif damage == "/dev/zero":
        f.unlink()
        f.symlink_to("/dev/zero")
    elif damage == "empty":
        f.write_bytes(b"")
    elif damage == "truncate":
        f.write_bytes(f.read_bytes()[:-4000])
    else:
        _set(trace_dir, num_steps=20)
    st = _status(trace_dir)
    assert st.valid and not st.complete and any(text in line for line in st.lines(pt.INCOMPLETE)), st.lines()
    assert st.summary().startswith("INCOMPLETE trace: ")
    report = run_checks(pt.open(trace_dir))
    assert not report.ok and not report.complete and "result: INCOMPLETE" in report.format()
    assert report.to_dict()["complete"] is False


def test_export_and_workbench_show_the_same_status(trace_dir, tmp_path):
    (trace_dir / "rank1.arrow").unlink()
    from pcpviz.views.export.html import export_html
    from pcpviz.views.widgets.workbench import Workbench

    line = _status(trace_dir).summary()
    html = Path(export_html(str(trace_dir), tmp_path / "r.html")).read_text()
    assert "INCOMPLETE trace" in html and "rank1.arrow: missing" in html
    wb = Workbench(str(trace_dir))
    assert wb.check_report.status.summary() == line
    assert wb.checks_box.get_title(0).startswith("✗ " + line)


def test_shipped_and_clean_traces_pass(trace_dir):
    assert _status(trace_dir).ok
    assert run_checks(pt.open(trace_dir)).ok


@pytest.mark.parametrize("argv", [["check"], ["explain", "--no-rerun"], ["export", "--chrome", "c.json"],
                                  ["export", "--html", "r.html"]])
@pytest.mark.parametrize("damage", ["no rank files", "rank files empty"])
def test_nothing_left_after_data_loss_is_exit_3(trace_dir, tmp_path, argv, damage):
    """Every rank file gone (or cut before its first step): the data was lost, so exit 3 with
    'incomplete:' lines, the same as a trace with some steps left, not 2 'no complete steps'."""
    import contextlib
    import io

    from pcpviz.cli import main

    for f in trace_dir.glob("rank*.arrow"):
        f.unlink() if damage == "no rank files" else f.write_bytes(b"")
    argv = [argv[0], str(trace_dir), *[str(tmp_path / a) if a in ("c.json", "r.html") else a for a in argv[1:]]]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc = main(argv)
    lines = err.getvalue().strip().splitlines()
    assert rc == 3 and lines and all(ln.startswith(f"pcpviz {argv[0]}: incomplete: ") for ln in lines), lines
    assert lines[-1] == f"pcpviz {argv[0]}: incomplete: {trace_dir}: no complete step is left"
