"""`pcpviz layout`: the text diagram, JSON output, and exit code 2 with a one-line
reason for bad input. Runs the installed console script in a subprocess."""

import json
import shutil
import subprocess
import sys

import pytest

from pcpviz.reference.layout import plan_layout


def pcpviz(*args):
    exe = shutil.which("pcpviz")
    cmd = [exe] if exe else [sys.executable, "-m", "pcpviz.cli"]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=120)


def test_layout_diagram_shows_rows_maps_and_mask():
    r = pcpviz("layout", "--pcp", "2", "--batch", "p13,d1,d4")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "per-rank tokens [6, 12]" in out
    # requests are named by letter, as in the lanes: 'd1' would read as a 1-token decode
    assert "requests: A = row 0 p13, B = row 1 d1, C = row 2 d4" in out
    assert "rank 0 rows: B[0:1] decode, A[0:4] chunk 0, A[12:13] chunk 3  + 6 padding" in out
    assert "rank 1 rows: C[0:4] decode, A[4:8] chunk 1, A[8:12] chunk 2" in out
    assert "gather_idx r0       [13  0  1  2  3 12  .  .  .  .  .  .]" in out
    assert "kv_write_mask r0    [W W W W W W - - - - - -]" in out
    assert "  rank 0  B AAAA a ......" in out


def test_layout_json_equals_library():
    r = pcpviz("layout", "--pcp", "4", "--batch", "p40,d2@31,p7@5,d1", "--decodes", "replicated")
    assert r.returncode == 0
    r = pcpviz("layout", "--pcp", "4", "--batch", "p40,d2@31,p7@5,d1", "--decodes", "replicated", "--json")
    doc = json.loads(r.stdout)
    assert doc["req_ids"] == ["A", "B", "C", "D"] and doc["rows"] == ["p40", "d2@31", "p7@5", "d1"]
    lay = plan_layout([40, 2, 7, 1], [True, False, True, False], 4, shard_decode_requests=False)
    assert doc["padded_gather_idx"] == lay.padded_gather_idx.tolist()
    assert doc["hidden_restore_idx"] == lay.hidden_restore_idx.tolist()
    assert doc["kv_write_mask"] == lay.kv_write_mask.tolist()
    assert doc["per_rank_num_tokens"] == list(lay.per_rank_num_tokens)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--pcp", "2", "--batch", "p13,x4"], "batch row 1 'x4' (rows count from 0) is not understood"),
        (["--pcp", "0", "--batch", "p13"], "--pcp: expected an integer in 1..1024, got 0"),
        (["--pcp", "2", "--batch", "p13", "--pad", "3"], "smaller than the largest rank-local batch: 3 < 8"),
        (["--pcp", "2", "--batch", ""], "empty batch description"),
        (["--pcp", "2"], "required: --batch"),
        (["--pcp", "2", "--batch", "p1,p3", "--dcp", "2", "--decodes", "sharded"], "no KV writer"),
    ],
)
def test_bad_input_exits_2_with_one_line_reason(args, needle):
    r = pcpviz("layout", *args)
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr
