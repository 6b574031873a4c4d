"""``pcpviz run --dcp``: the options the engine's DCP refuses, each in one line naming the option."""

import subprocess
import sys

import pytest

from pcpviz.engine.run_config import build_config


@pytest.mark.parametrize("kw,match", [
    (dict(pcp=2, dcp=3), r"dcp=3: the engine's DCP spans the PCP group, so dcp must be 1 or pcp=2"),
    (dict(pcp=2, dcp=2, dcp_interleave=3), r"dcp_interleave=3 must be >= 1 and divide block_size=16"),
    (dict(pcp=2, dcp=2, cuda_graphs=True), r"cuda_graphs with dcp > 1"),
    (dict(pcp=2, dcp=2, shard_decode_requests=True), r"decodes are replicated under DCP"),
])
def test_bad_dcp_options_are_one_line_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        build_config(["x = "], max_new_tokens=2, **kw)


def test_dcp_config_is_recorded():
    cfg = build_config(["x = "], pcp=2, dcp=2, dcp_interleave=4, max_new_tokens=2)
    assert (cfg.dcp, cfg.dcp_interleave) == (2, 4)
    assert build_config(["x = "], pcp=2, max_new_tokens=2).dcp == 1


def test_cli_refuses_a_dcp_that_is_not_the_pcp(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pcpviz", "run", "--pcp", "2", "--dcp", "4", "--prompt", "x",
                        "--max-new-tokens", "2"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "dcp=4" in lines[0] and "Traceback" not in r.stderr
