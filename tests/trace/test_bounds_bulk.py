"""``step_problems`` judges a step in bulk (shape rules memoized, one min/max per dtype) and must
give the lines the view-by-view reference gives, in the same order, also on damaged records."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np

import pcpviz.trace as pt
from pcpviz.trace import bounds as B

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "data" / "traces" / "cpu-pcp2-mtp2"


def reference(phases) -> list[str]:
    """The view-by-view rule: every view's ``_view_problem``, then the token counts."""
    out = [why for ph, views in phases.items() for name, v in views.items()
           for why in (B._view_problem(ph, name, v),) if why]
    target = phases.get("target")
    if target is not None and not any(p.startswith("target.") for p in out):
        why = B._token_count_problem(target)
        if why:
            out.append(why)
    return out


def _damage(rng: random.Random, phases: dict) -> dict:
    out = {p: dict(v) for p, v in phases.items()}
    p = rng.choice(sorted(out))
    name = rng.choice(sorted(out[p]))
    a = np.array(out[p][name])
    kind = rng.randrange(6)
    if kind < 2 and a.size and a.dtype.kind in "iu":
        a = a.astype(np.int64)
        a.ravel()[rng.randrange(a.size)] = (2**40, -7)[kind]
    elif kind == 2 and a.dtype.kind in "iu":
        a = a.astype(float)
    elif kind == 3:
        a = a.reshape((1,) + a.shape)
    elif kind == 4 and a.dtype.names:
        a = a.copy()
        a[a.dtype.names[0]] = -5
    else:
        a = a.ravel()[:max(0, a.size - 1)]
    out[p][name] = a
    return out


def test_bulk_bounds_equal_the_view_by_view_rule():
    t = pt.open(TRACE)
    rng = random.Random(3)
    broken = 0
    for s in t.steps:
        for r in t.ranks:
            phases = {p: dict(t.record(s, r, p)) for p in t.phases(s, r)}
            for v in [phases] + [_damage(rng, phases) for _ in range(8)]:
                want = reference(v)
                memo: dict = {}
                assert B.step_problems(v) == want
                assert B.step_problems(v, memo=memo) == want
                assert B.step_problems(v, memo=memo) == want  # answered from the memo
                broken += bool(want)
    assert broken > 50  # the damage did break bounds
