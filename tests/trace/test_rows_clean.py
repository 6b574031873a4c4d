"""``bounds.rows_clean`` reads a step's index bounds from its batch's bytes (one gather per dtype)
and must say True only where ``_clean`` says True of the decoded records: on every (step, rank)
of the shipped traces, and on their bytes damaged to break a bound."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

import pcpviz.trace as pt
from pcpviz.limits import MAX_INDEX
from pcpviz.trace import bounds as B
from tracegen import clean_run

ROOT = Path(__file__).resolve().parents[2]
TRACES = sorted(p for p in (ROOT / "data" / "traces").iterdir() if (p / "run.json").exists())


def _records(layout, loaded, u8: np.ndarray, strings: dict) -> dict:
    """The step's views as the reader decodes them, over ``u8`` (numeric rows as views of it)."""
    out: dict = {}
    for phase, rows in layout.phases.items():
        out[phase] = {layout.views[j]: strings[j] if layout.dtypes[j] is None else
                      np.ndarray(loaded.shapes[j], layout.dtypes[j], u8, loaded.offsets[j]) for j in rows}
    return out


def _damaged(rng: random.Random, layout, loaded) -> np.ndarray:
    """The payload bytes with one numeric element set to a value out of bounds, or in bounds."""
    u8 = np.array(loaded.u8)
    rows = [j for j, dt in enumerate(layout.dtypes) if dt is not None and dt.kind in "iu"
            and loaded.offsets[j + 1] - loaded.offsets[j] >= dt.itemsize]
    if not rows:
        return u8
    j = rng.choice(rows)
    dt = layout.dtypes[j]
    n = (loaded.offsets[j + 1] - loaded.offsets[j]) // dt.itemsize
    at = loaded.offsets[j] + rng.randrange(n) * dt.itemsize
    info = np.iinfo(dt)
    value = rng.choice([min(info.max, MAX_INDEX + 1), max(info.min, -7), -1, 0, min(info.max, MAX_INDEX)])
    u8[at:at + dt.itemsize] = np.frombuffer(np.array([value], dtype=dt).tobytes(), np.uint8)
    return u8


@pytest.mark.parametrize("trace", TRACES + [(2, 3), (4, 1), (3, 2)],
                         ids=[p.name for p in TRACES] + ["synthetic-pcp2-k3", "synthetic-pcp4-k1", "synthetic-pcp3-k2"])
def test_rows_clean_says_true_only_where_the_views_are_clean(trace, tmp_path):
    if isinstance(trace, tuple):
        trace = clean_run(*trace).write(tmp_path / "trace")
    t = pt.open(trace)
    if t.version < 2:
        pytest.skip("the reader upgrades older views: rows_clean is not asked")
    rng = random.Random(7)
    said = agreed = 0
    for s in t.steps:
        for r in t.ranks:
            if s not in t.files[r].steps:
                continue
            recs, clean = t.step_records_clean(s, r)
            ix, i = t._entry(s, r)
            layout, loaded = ix.layouts[i], ix.batch(i)
            strings = {j: recs[layout.phase_of[j]][layout.views[j]] for j, dt in enumerate(layout.dtypes)
                       if dt is None}
            assert clean == B.rows_clean(layout, loaded.shapes, loaded.offsets_array, u8=loaded.u8, strings=strings)
            truth = B._clean(recs, None)
            assert truth or not clean
            said += clean
            agreed += truth
            for _ in range(4):
                u8 = _damaged(rng, layout, loaded)
                u8.flags.writeable = False
                fast = B.rows_clean(layout, loaded.shapes, loaded.offsets_array, u8=u8, strings=strings)
                slow = B._clean(_records(layout, loaded, u8, strings), None)
                assert slow or not fast, (s, r)
                if B._rows_plan(layout, loaded.shapes) is not None:
                    assert fast == slow, (s, r)
    assert said == agreed  # the shipped steps are small: every clean one is told so from its bytes


def test_a_long_view_is_left_to_the_full_walk():
    class _Layout:
        phases = {"target": (0,)}
        views, phase_of, dtypes = ("positions",), ("target",), (np.dtype("<i8"),)

    shapes = ((B.PLAN_ELEMENTS + 1,),)
    u8 = np.zeros(8 * (B.PLAN_ELEMENTS + 1), dtype=np.uint8)
    offsets = np.array([0, u8.shape[0]], dtype=np.int64)
    assert B._rows_plan(_Layout, shapes) is None
    assert not B.rows_clean(_Layout, shapes, offsets, u8=u8, strings={})
    shapes = ((3,),)
    u8 = np.frombuffer(np.array([0, 5, -1], dtype="<i8").tobytes(), np.uint8)
    assert B.rows_clean(_Layout, shapes, np.array([0, 24]), u8=u8, strings={})
    u8 = np.frombuffer(np.array([0, 5, 2**40], dtype="<i8").tobytes(), np.uint8)
    assert not B.rows_clean(_Layout, shapes, np.array([0, 24]), u8=u8, strings={})
