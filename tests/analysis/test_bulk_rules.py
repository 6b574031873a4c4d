"""The checks' bulk rules (``pcpviz.analysis.checks.columns``) change no report: on clean and
damaged traces the report with the rules on equals the report with every check run per step
(``PCPVIZ_BULK=0``: verdicts, counts, first violations, every failing (step, rank), skip
reasons), and ``PCPVIZ_BULK=verify`` (every check run as well, each rule's "passes" checked
against the check) raises nothing: a rule never says pass where its check fails or skips."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pcpviz.analysis.checks import run_checks, runner
from pcpviz.analysis.checks.columns import BULK, BULK_ENV, Column, ragged
from tracegen import clean_run, corrupt

# the views the bulk rules read, and others ranks_agree compares
VIEWS = [("target", v) for v in (
    "padded_gather_idx", "hidden_restore_idx", "num_scheduled_tokens", "local_positions", "positions",
    "per_rank_num_tokens", "local_seq_lens", "local_query_start_loc", "sampled_logits_rows",
    "logits_indices", "sampled_from", "req_ids", "segments", "is_prefilling", "input_ids",
    "block_table_global", "slot_mapping_global", "slot_mapping_gathered", "kv_write_mask", "hidden_fp",
    "local_req_ids", "local_logits_indices", "local_input_ids", "local_is_padding", "block_table_local",
    "hidden_local_fp", "seq_lens", "num_computed_tokens", "prefill_len", "top1_token")] + [("verify", v) for v in (
        "num_sampled", "sampled_token_ids", "num_rejected", "num_accepted", "num_draft_tokens",
        "req_ids", "num_computed_after", "idx_mapping")] + [("draft_0", v) for v in (
            "draft_tokens", "draft_last_token_indices", "hidden_in_fp", "hidden_out_fp", "hidden_last_fp",
            "mtp_local_fp", "draft_global_input_ids", "draft_input_ids", "slot_mapping_draft", "draft_positions",
            "draft_seq_lens", "block_table_draft", "view")] + [("draft_1", "hidden_in_fp"),
                                                                ("draft_1", "draft_input_ids")]


def _plus_one(a, rng):
    if a.size == 0 or a.dtype.kind not in "iu":
        return a
    a = a.copy()
    a.reshape(-1)[rng.randrange(a.size)] += 1
    return a


def _minus_one(a, rng):
    if a.size == 0 or a.dtype.kind not in "iu":
        return a
    a = a.astype(np.int64)
    a.reshape(-1)[rng.randrange(a.size)] = -1
    return a


def _repeat_first(a, rng):
    if a.ndim == 0 or a.shape[-1] < 2 or a.dtype.names is not None:
        return a
    a = a.copy()
    a[..., 1] = a[..., 0]
    return a


def _huge(a, rng):
    if a.size == 0 or a.dtype.kind not in "iu":
        return a
    a = a.astype(np.int64)
    a.reshape(-1)[rng.randrange(a.size)] = rng.choice([2**40, -7])  # out of bounds: a malformed step
    return a


DAMAGE = {
    "repeat_first": _repeat_first,
    "huge": _huge,
    "plus_one": _plus_one,
    "minus_one": _minus_one,
    "roll": lambda a, rng: np.roll(a, 1),
    "shorter": lambda a, rng: a[:-1] if a.ndim and a.shape[0] else a,
    "longer": lambda a, rng: np.concatenate([a, a[-1:]]) if a.ndim == 1 and a.shape[0] else a,
    "floats": lambda a, rng: a.astype(np.float64) if a.dtype.kind in "iu" else a,
    "int32": lambda a, rng: a.astype(np.int32) if a.dtype.kind in "iu" else a,
    "empty": lambda a, rng: a[:0] if a.ndim else a,
    "text": lambda a, rng: np.array(["local"]) if a.dtype.kind == "U" else a,
    "bools": lambda a, rng: a.astype(bool) if a.dtype.kind in "iu" else a,
    "one_more_axis": lambda a, rng: a[None],
    "no_group_axis": lambda a, rng: a[0] if a.ndim == 2 else a,
}


def _facts(report):
    return {n: (r.verdict, r.evaluated, r.failed, r.skipped, r.skip_reason, r.first_violation, r.failures)
            for n, r in report.results.items()}


def _both(path, monkeypatch):
    monkeypatch.setenv(BULK_ENV, "0")
    off = run_checks(path, workers=1)
    monkeypatch.setenv(BULK_ENV, "verify")
    run_checks(path, workers=1)  # raises AssertionError where a rule is unsound
    monkeypatch.setenv(BULK_ENV, "always")  # the small traces here: rules on every block
    on = run_checks(path, workers=1)
    return off, on


def test_rules_registered_next_to_their_checks():
    from pcpviz.analysis.checks import CHECKS
    assert {"ranks_agree", "local_positions_are_global", "restore_gather_identity"} <= set(BULK)
    assert set(BULK) <= set(CHECKS)


def test_column_and_ragged():
    col = Column.of([np.array([0, 1, 2]), None, np.array([7])])
    assert col.values.tolist() == [0, 1, 2, 7] and col.offsets.tolist() == [0, 3, 3, 4]
    vals, ok = col.at(np.array([0, 1, 2, 2]), np.array([2, 0, 0, 1]))
    assert vals.tolist() == [2, 0, 7, 0] and ok.tolist() == [True, False, True, False]
    assert Column.of([np.array([1.0])]) is None and Column.of([np.array([1], np.int32), np.array([1])]) is None
    seg, k = ragged(np.array([2, 0, 1]))
    assert seg.tolist() == [0, 0, 2] and k.tolist() == [0, 1, 0]


@pytest.mark.parametrize("pcp,k", [(2, 2), (2, 1), (4, 3)])
def test_clean_runs_same_report(tmp_path, monkeypatch, pcp, k):
    path = clean_run(pcp=pcp, k=k).write(tmp_path / "clean")
    off, on = _both(path, monkeypatch)
    assert _facts(on) == _facts(off)


@pytest.mark.parametrize("seed", range(60))
def test_damaged_runs_same_report(tmp_path, monkeypatch, seed):
    if seed % 2:  # blocks of 3 steps: a previous step read from the block before
        monkeypatch.setattr(runner, "BLOCK_STEPS", 3)
    if seed % 3 == 0:  # blocks of one step (their views past BLOCK_BYTES)
        monkeypatch.setattr(runner, "BLOCK_BYTES", 1)
    rng = random.Random(seed)
    run = clean_run(pcp=rng.choice([2, 2, 4]), k=rng.choice([1, 2, 3]))
    steps = [s for s, _ in run.steps]
    for _ in range(rng.choice([1, 2, 3])):
        phase, view = rng.choice(VIEWS)
        step = rng.choice(steps)
        per_rank = dict(run.steps)[step]
        if phase not in per_rank[0] or view not in per_rank[0][phase]:
            continue
        damage = DAMAGE[rng.choice(sorted(DAMAGE))]
        ranks = rng.choice([None, [0], [1]])
        corrupt(run, step, phase, view, lambda a: damage(a, rng), ranks=ranks)
    path = run.write(tmp_path / "damaged")
    off, on = _both(path, monkeypatch)
    assert _facts(on) == _facts(off)


def test_default_mode_rules_decide_long_runs(tmp_path, monkeypatch):
    """By default the rules run on blocks of BULK_MIN_STEPS steps and more (here 150 repeated
    tiny steps), decide most (step, rank) there, and change no report; a short trace is checked
    per step."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "bench_scale", Path(__file__).resolve().parents[2] / "benchmarks" / "bench_scale.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    path = bench.tiny_steps(tmp_path / "steps", 150)
    decided = []
    real = runner.decide_arrays

    def counting(block, names, ranks):
        sure, skips = real(block, names, ranks)
        decided.append(sum(int(ok.sum()) for ok in sure.values()) + sum(map(len, skips.values())))
        return sure, skips

    monkeypatch.setattr(runner, "decide_arrays", counting)
    monkeypatch.setenv(BULK_ENV, "0")
    off = run_checks(path, workers=1)
    monkeypatch.delenv(BULK_ENV)
    on = run_checks(path, workers=1)
    assert _facts(on) == _facts(off) and not on.ok
    assert sum(decided) > 0.5 * 150 * 2 * len(on.results)  # most (step, rank, check) decided in bulk
    decided.clear()
    run_checks(clean_run(pcp=2, k=2).write(tmp_path / "short"), workers=1)
    assert decided == [] or sum(decided) == 0


def test_column_of_equals_the_step_by_step_reference():
    """``Column.of`` (one pass over the arrays' signatures) equals the reference: None unless every
    present array is an ndarray of one integer or bool dtype (not uint64) and 1 to 3 axes."""
    rng = random.Random(11)
    dtypes = [np.int64, np.int32, np.uint8, bool, np.uint64, np.float64]
    for _ in range(400):
        dt, ndim = rng.choice(dtypes), rng.choice([0, 1, 2, 3])
        arrays = []
        for _ in range(rng.randrange(0, 6)):
            pick = rng.random()
            shape = tuple(rng.randrange(0, 3) for _ in range(ndim))
            if pick < 0.2:
                arrays.append(None)
            elif pick < 0.25:
                arrays.append(np.zeros(shape, dtype=rng.choice(dtypes)))
            elif pick < 0.27:
                arrays.append([1, 2])
            else:
                arrays.append(np.arange(int(np.prod(shape)), dtype=np.int64).astype(dt).reshape(shape))
        col = Column.of(arrays)
        present = [a for a in arrays if a is not None]
        sigs = {(type(a), getattr(a, "dtype", None), getattr(a, "ndim", None)) for a in present}
        fits = len(sigs) == 1 and type(present[0]) is np.ndarray and present[0].ndim in (1, 2, 3) \
            and present[0].dtype.kind in "iub" and present[0].dtype != np.uint64
        if not present:
            assert col is not None and not col.present.any() and col.values.size == 0
            continue
        assert (col is not None) == fits
        if col is None:
            continue
        assert col.present.tolist() == [a is not None for a in arrays]
        assert col.values.tolist() == [int(x) for a in present for x in a.ravel()]
        assert col.lens.tolist() == [0 if a is None else a.size for a in arrays]
        assert col.dims.tolist() == [[0] * present[0].ndim if a is None else list(a.shape) for a in arrays]
