"""One config type from the command line to the ranks (issue 40): ``build_config`` (what ``pcpviz run``
and ``pcpviz.run`` call) returns a frozen ``RunConfig``; the file the launcher and ``--write-config``
write decodes back into the same value in the rank; a damaged file is one line naming it and the
key; a rank started with another WORLD_SIZE than the config's pcp stops with one line; run.json is
the one shipped traces hold."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pcpviz.cli import main
from pcpviz.engine.run_config import RunConfig, build_config
from pcpviz.engine.trace_dir import trace_meta

ROOT = Path(__file__).resolve().parents[2]


def _cfg(**kw) -> RunConfig:
    return build_config(["def add(a, b):", [256, 100, 101]], pcp=2, num_speculative_tokens=2, **kw)


def test_the_config_is_one_frozen_type_and_round_trips(tmp_path):
    cfg = _cfg()
    assert isinstance(cfg, RunConfig)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.pcp = 3
    assert cfg.prompt_token_ids[1] == (256, 100, 101) and cfg.inject == ()
    path = tmp_path / "config.json"
    ranked = dataclasses.replace(cfg, work_dir=str(tmp_path), store_file=str(tmp_path / "store"))
    ranked.to_json(str(path))
    assert RunConfig.from_json(str(path)) == ranked
    assert json.loads(path.read_text())["prompt_token_ids"][1] == [256, 100, 101]


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(pcp="2"), "pcp: expected int, got str"),
    (lambda d: d.update(pcp=True), "pcp: expected int, got bool"),
    (lambda d: d.pop("block_size"), "block_size: missing"),
    (lambda d: d.update(blocksize=16), "blocksize: not a key of a run config"),
    (lambda d: d.update(prompt_token_ids=[[1, "x"]]), "prompt_token_ids[0][1]: expected int, got str"),
    (lambda d: d.update(trace_dir=7), "trace_dir: expected str, got int"),
])
def test_a_damaged_config_is_one_line_naming_the_file_and_key(tmp_path, edit, message):
    doc = _cfg().to_dict()
    edit(doc)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError) as err:
        RunConfig.from_json(str(path))
    assert str(err.value) == f"{path}: {message}"
    path.write_text("{")
    with pytest.raises(ValueError, match=f"^{path}: "):
        RunConfig.from_json(str(path))


def test_run_json_keeps_the_shipped_keys():
    # a shipped engine trace's run.json: the same keys, the same types
    shipped = json.loads((ROOT / "data" / "traces" / "cpu-pcp2-mtp2" / "run.json").read_text())
    meta = trace_meta(_cfg()).to_json()
    assert meta.pop("pcpviz_trace_schema") == 2  # RunMeta.build stamps the writer's version
    assert set(meta) - set(shipped) == {"dtype", "model_moe"}  # added after this trace was recorded
    assert set(shipped) - set(meta) == {"pcpviz_trace_schema"}  # the writer's
    assert {k: type(v) for k, v in meta.items() if k in shipped} == {k: type(shipped[k]) for k in meta if k in shipped}


def test_a_rank_refuses_a_world_size_other_than_pcp(tmp_path):
    path = tmp_path / "c.json"
    dataclasses.replace(_cfg(), work_dir=str(tmp_path)).to_json(str(path))
    env = dict(os.environ, WORLD_SIZE="3", RANK="0", PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "pcpviz.engine.rank_main", str(path)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip() == f"pcpviz rank: {path}: pcp: 2, but WORLD_SIZE is 3 (start as many ranks as pcp)"


def test_write_config_writes_the_run_config(tmp_path, capsys):
    cfg = tmp_path / "run.cfg.json"
    assert main(["run", "--pcp", "2", "--mtp", "1", "--prompt", "x = ", "--trace", str(tmp_path / "t"),
                 "--write-config", str(cfg)]) == 0, capsys.readouterr().err
    got = RunConfig.from_json(str(cfg))
    assert (got.pcp, got.num_speculative_tokens, got.work_dir) == (2, 1, str(tmp_path / "run.cfg-work"))
    assert got.trace_dir == str(tmp_path / "t") and got.trace_owner
