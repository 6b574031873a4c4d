"""A trace is read by the rules of the schema version that wrote it (``schema.SCHEMA_VERSIONS``,
``schema.upgrade_views``).

Version 1 (before vLLM's plugin masked ``sampled_token_ids`` past ``num_sampled``) left those
entries unspecified: a rejected draft, an older step's token, different on each rank. Read as
version 1 they are padding and the checks pass; the same bytes claimed as version 2 break the
rule that they are -1, and ``verify_consistent`` and ``ranks_agree`` fail.
"""

from __future__ import annotations

import numpy as np
import pytest

import pcpviz.trace as pt
from pcpviz.analysis.checks import run_checks
from pcpviz.trace import schema as S
from tracegen import clean_run


def _write(tmp_path, name, version, monkeypatch):
    run = clean_run(2)
    d = tmp_path / name
    monkeypatch.setattr(S, "SCHEMA_VERSION", version)
    try:
        run.write(d)
    finally:
        monkeypatch.undo()
    # re-write each verify record with stale tokens past num_sampled, different per rank
    t = pt.open(d)
    out = tmp_path / (name + "-stale")
    monkeypatch.setattr(S, "SCHEMA_VERSION", version)
    try:
        meta = {k: v for k, v in t.meta.items() if k != S.META_SCHEMA_KEY}
        stale = 0
        for rank in t.ranks:
            with pt.TraceWriter(out, rank, meta=meta if rank == 0 else None) as w:
                for step in t.rank_steps(rank):
                    phases = {ph: {k: np.array(v) for k, v in t.record(step, rank, ph).items()}
                              for ph in t.phases(step, rank)}
                    ver = phases.get("verify")
                    if ver is not None:
                        s, ns = ver["sampled_token_ids"], ver["num_sampled"]
                        past = np.arange(s.shape[1])[None, :] >= ns[:, None]
                        ver["sampled_token_ids"] = np.where(past, 1000 + 7 * rank + step, s)
                        stale += int(past.sum())
                    w.write_step(step, phases)
    finally:
        monkeypatch.undo()
    assert stale > 0
    return out


def test_version_1_trace_is_read_by_version_1_rules(tmp_path, monkeypatch):
    old = _write(tmp_path, "v1", 1, monkeypatch)
    t = pt.open(old)
    assert t.version == 1 and t.meta[S.META_SCHEMA_KEY] == 1
    report = run_checks(t)
    assert report.ok, report.format()
    # the stale entries read as the padding the current version writes
    rec = t.record(t.steps[0], 0, "verify")
    s, ns = np.asarray(rec["sampled_token_ids"]), np.asarray(rec["num_sampled"])
    assert (s[np.arange(s.shape[1])[None, :] >= ns[:, None]] == -1).all()


def test_the_same_bytes_as_version_2_fail(tmp_path, monkeypatch):
    new = _write(tmp_path, "v2", 2, monkeypatch)
    t = pt.open(new)
    assert t.version == S.SCHEMA_VERSION == 2
    report = run_checks(t)
    assert {"verify_consistent", "ranks_agree"} <= set(report.failed), report.format()


def test_every_version_has_its_rules_and_newer_is_refused(tmp_path):
    assert sorted(S.SCHEMA_VERSIONS) == list(range(1, S.SCHEMA_VERSION + 1))
    views = {"sampled_token_ids": np.array([[5, 9, 7]]), "num_sampled": np.array([1])}
    assert S.upgrade_views(1, "verify", views)["sampled_token_ids"].tolist() == [[5, -1, -1]]
    assert S.upgrade_views(2, "verify", views)["sampled_token_ids"].tolist() == [[5, 9, 7]]
    assert S.upgrade_views(1, "target", views) is views
    pt.write_run_meta(tmp_path, {"producer": "x"})
    (tmp_path / "run.json").write_text('{"pcpviz_trace_schema": %d}' % (S.SCHEMA_VERSION + 1))
    with pytest.raises(pt.TraceError, match="newer than this pcpviz"):
        pt.open(tmp_path)
