"""`pcpviz run` end to end: the JSON summary, the trace, fault listing, exit codes."""

import pytest
import json
import re
import shutil
import subprocess
from pathlib import Path
import sys

import pcpviz.trace as pt


def pcpviz(*args, timeout=300):
    exe = shutil.which("pcpviz")
    cmd = [exe] if exe else [sys.executable, "-m", "pcpviz.cli"]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_run_writes_summary_and_trace(tmp_path):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["import re\n", "def add(a, b):\n    return"]))
    out = tmp_path / "summary.json"
    r = pcpviz("run", "--pcp", "2", "--mtp", "2", "--device", "cpu", "--prompt", "x = [",
               "--prompts-file", str(prompts), "--max-new-tokens", "6", "--trace", str(tmp_path / "tr"),
               "--json", str(out), "--quiet")
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert len(doc["requests"]) == 3
    assert all(len(q["output_token_ids"]) == 6 and q["prompt_token_ids"][0] == 256 for q in doc["requests"])
    assert len(doc["acceptance_rate_per_pos"]) == 2 and 0 <= doc["acceptance_rate"] <= 1
    trace = pt.open(tmp_path / "tr")
    assert trace.ranks == [0, 1] and trace.meta["num_speculative_tokens"] == 2
    assert "acceptance per position" in r.stdout


def test_list_faults_names_each_check():
    r = pcpviz("run", "--list-faults")
    assert r.returncode == 0
    for name in ("skip_draft_block_table_gather", "fold_slot_mapping_without_shape_check",
                 "positions_from_cpu_cursor", "sample_local_logits", "rank_divergent_acceptance"):
        assert name in r.stdout
    from pcpviz.faults import ENGINE, faults_of

    assert all(name in r.stdout for name in faults_of(ENGINE))
    assert r.stdout.count("caught by:") == len(faults_of(ENGINE))


@pytest.mark.slow
def test_bad_run_input_exits_2_with_one_line(tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text("{not json")
    for args, needle in (
        (["--inject", "bogus", "--prompt", "x"], "unknown fault 'bogus'"),
        (["--prompts-file", str(bad)], "p.json"),
        ([], "give at least one --prompt"),
        (["--pcp", "0", "--prompt", "x"], "--pcp"),
        (["--prompt", "x", "--max-new-tokens", "40000"], "exceed the model's context"),
    ):
        r = pcpviz("run", *args)
        assert r.returncode == 2, (args, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], r.stderr


@pytest.mark.slow
def test_torchrun_launches_the_same_ranks(tmp_path):
    """`--write-config` + torchrun (env:// rendezvous, as across hosts) gives pcpviz run's tokens."""
    cfg = tmp_path / "run.cfg.json"
    r = pcpviz("run", "--pcp", "2", "--mtp", "2", "--prompt", "def add(a, b):", "--max-new-tokens", "8",
               "--trace", str(tmp_path / "tr"), "--write-config", str(cfg))
    assert r.returncode == 0, r.stderr
    assert "torchrun" in r.stdout and cfg.exists()
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    p = subprocess.run([torchrun, "--nproc-per-node", "2", "-m", "pcpviz.engine.rank_main", str(cfg)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "PCPVIZ_PROGRESS" not in p.stdout  # the launcher's pipe protocol; torchrun shows lines for people
    assert re.search(r"pcpviz rank 0: step \d+, prefill 15/15 prompt tokens, 8/8 new tokens", p.stdout), p.stdout
    result = json.loads((tmp_path / "run.cfg-work" / "result.json").read_text())
    direct = pcpviz("run", "--pcp", "2", "--mtp", "2", "--prompt", "def add(a, b):", "--max-new-tokens", "8",
                    "--json", str(tmp_path / "direct.json"), "--quiet")
    assert direct.returncode == 0
    want = json.loads((tmp_path / "direct.json").read_text())["requests"][0]["output_token_ids"]
    assert result["requests"][0]["output_token_ids"] == want
    assert pt.open(tmp_path / "tr").ranks == [0, 1]
