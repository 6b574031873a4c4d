"""``token_counts_ok`` (the token counts of a block judged at once) is sound against the rule it
stands for, ``pcpviz.trace.bounds._token_count_problem``: on random blocks of steps with
damaged, missing, 2-D, bool and empty views it never says "agrees" where the rule gives a line,
and it says so on every step left intact (a rule that decided nothing would pass the first half)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pcpviz.analysis.checks.columns import Block
from pcpviz.analysis.checks.token_columns import token_counts_ok
from pcpviz.trace.bounds import _token_count_problem


class _Step:
    def __init__(self, target: dict | None):
        self.recs = {0: {} if target is None else {"target": target}}


def _intact(rng: random.Random) -> dict:
    counts = np.array([rng.randrange(0, 5) for _ in range(rng.randrange(1, 4))], dtype=np.int64)
    t = int(counts.sum())
    return {"positions": np.arange(t, dtype=np.int64), "input_ids": np.arange(t, dtype=np.int32) + 7,
            "num_scheduled_tokens": counts.astype(np.int32),
            "query_start_loc": np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)}


def _damaged(rng: random.Random, *, retype: bool) -> dict:
    """An intact step with one to three of its views damaged or dropped (so that each of the
    rule's conditions is met alone: with a view gone the others no longer imply it); ``retype``:
    also by changing a dtype or axes (a block of mixed dtypes or axes has no column: nothing in
    it is decided)."""
    v = _intact(rng)
    for _ in range(rng.randrange(1, 4)):
        if v:
            _damage(v, rng.choice(sorted(v)), rng.choice(range(9) if retype else (0, 1, 3, 4, 6, 7)), rng)
    return v


def _damage(v: dict, name: str, how: int, rng: random.Random) -> None:
    a = v[name]
    if how == 0:
        del v[name]
    elif how == 1:
        a = np.concatenate([a, [5]]).astype(a.dtype) if not a.size else a.copy()
        a.reshape(-1)[rng.randrange(a.size)] += rng.choice([-3, -1, 1, 2])
        v[name] = a
    elif how == 2:
        v[name] = a.reshape(1, -1)  # 2-D: the rule reads past it
    elif how == 3:
        v[name] = a[:-1]
    elif how == 4:
        v[name] = np.concatenate([a, a[-1:]]) if a.size else np.zeros(1, a.dtype)
    elif how == 5:
        v[name] = a.astype(bool)
    elif how == 6:
        v[name] = a[:0]
    elif how == 7:
        v[name] = a[::-1].copy()
    elif "positions" in v:
        v["positions"] = v["positions"].reshape(1, -1)  # the token axis from input_ids


@pytest.mark.parametrize("seed", range(100))
def test_token_counts_ok_never_passes_a_step_the_rule_fails(seed):
    rng = random.Random(seed)
    retype = seed % 2 == 1
    targets, intact = [], []
    for _ in range(rng.randrange(1, 60)):
        kind = rng.randrange(10)
        targets.append(None if kind == 0 else _intact(rng) if kind < 5 else _damaged(rng, retype=retype))
        intact.append(kind < 5)
    ok = token_counts_ok(Block([_Step(t) for t in targets], None), 0)
    assert ok.shape == (len(targets),)
    for i, t in enumerate(targets):
        why = None if t is None else _token_count_problem(t)
        if ok[i]:
            assert why is None, (i, t, why)
        if intact[i] and not retype:
            assert ok[i], (i, t)
    if retype and all(intact):
        assert ok.all()


def test_token_counts_ok_names_the_steps_that_break_it():
    good = {"positions": np.arange(3), "num_scheduled_tokens": np.array([1, 2]),
            "query_start_loc": np.array([0, 1, 3])}
    short = dict(good, query_start_loc=np.array([0, 1, 2]))
    negative = dict(good, num_scheduled_tokens=np.array([-1, 4]), query_start_loc=np.array([0, -1, 3]))
    alone = {"positions": np.arange(3), "num_scheduled_tokens": np.array([-1, 4])}  # sums to 3: only its sign
    falls = {"positions": np.arange(3), "query_start_loc": np.array([0, 4, 3])}  # no counts: only its rise
    steps = [good, short, None, negative, alone, falls]
    ok = token_counts_ok(Block([_Step(t) for t in steps], None), 0)
    assert ok.tolist() == [True, False, True, False, False, False]
    assert [t is None or _token_count_problem(t) is None for t in steps] == ok.tolist()
