"""The diagnosis benchmark's fast subset (benchmarks/bench_diagnosis.py): bugs outside the fault
catalogue, patched into a copy of the package and run on the CPU engine at PCP=2, K=2, must fail
`check` with the first evidence at the bug's own phase and view, diverge in `diff`, and get an
honest `explain` (never a catalogued fault named "matches", never CLEAN); a harmless refactor
must raise no alarm. One engine run per case (a Python + torch start per rank), so the subset
is four bugs (block tables, hidden-state restore, verification, what the next step is fed) and
one refactor; the full table is the benchmark's."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

from pcpviz.analysis.explain import CLEAN, FAULT
from pcpviz.analysis.mutations import MUTATIONS
from pcpviz.analysis.producers import VLLM, find_def
from pcpviz.analysis.vllm_mutations import VLLM_MUTATIONS

ROOT = Path(__file__).resolve().parents[2]
SUBSET = ["draft_block_table_wrong_request", "draft_hidden_not_restored", "extra_accepted_draft",
          "drafts_fed_to_wrong_request", "refactor_shift_with_roll"]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_diagnosis", ROOT / "benchmarks" / "bench_diagnosis.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    bench = _bench()
    bench.SETTINGS["ci"] = dict(bench.SETTINGS["pcp2-k2"], max_new_tokens=10)
    return {r.mutation: r for r in bench.bench(["ci"], SUBSET, work=tmp_path_factory.mktemp("diag"))}


def test_the_subset_names_real_mutations():
    names = {m.name for m in MUTATIONS}
    assert set(SUBSET) <= names
    assert len([m for m in MUTATIONS if not m.harmless]) >= 20 and sum(m.harmless for m in MUTATIONS) >= 3


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in SUBSET if not n.startswith("refactor_")])
def test_an_uncatalogued_bug_is_found_and_never_blamed_on_a_wrong_fault(rows, name):
    r = rows[name]
    assert r.ran and r.exercised, r
    assert r.check_fails and r.at_own_place, r.first
    assert r.diverges
    assert r.verdict not in (CLEAN, FAULT), r  # honest: the mechanism, not a catalogued fault


@pytest.mark.slow
def test_a_harmless_refactor_raises_no_alarm(rows):
    r = rows["refactor_shift_with_roll"]
    assert r.ran and not r.alarm and r.verdict == CLEAN, r


@pytest.mark.parametrize("m", MUTATIONS, ids=lambda m: m.name)
def test_every_mutation_still_patches_its_file(m):
    """Each mutation's text occurs exactly once in its file: a refactor that moves or rewrites
    the code a mutation patches must move the mutation with it."""
    src = (ROOT / "pcpviz" / m.file).read_text()
    assert src.count(m.old) == 1, f"{m.name}: {m.old!r} occurs {src.count(m.old)} times in pcpviz/{m.file}"


PRODUCERS = {"draft_block_table_wrong_request": "Worker._write_input_block_tables",
             "draft_hidden_not_restored": "_draft_prefill", "extra_accepted_draft": "greedy_verify",
             "drafts_fed_to_wrong_request": "Worker._resolve_drafts"}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PRODUCERS))
def test_the_named_producer_is_the_patched_function(rows, name):
    r = rows[name]
    assert r.named == PRODUCERS[name] and r.producer_right, r


@pytest.mark.slow
def test_a_chunked_prefill_must_sample_bug_fails_its_own_rule(tmp_path):
    """The sampler's must-sample rule one chunk early (the chunk before a prompt's last samples):
    every check that takes num_sampled on trust passes it; must_sample_rule fails at verify.num_sampled."""
    bench = _bench()
    bench.SETTINGS["ci-chunked"] = dict(bench.SETTINGS["pcp4-k3-chunked"], pcp=2, max_new_tokens=6)
    (r,) = bench.bench(["ci-chunked"], ["must_sample_a_chunk_early"], work=tmp_path)
    assert r.ran and r.check_fails and r.at_own_place, r.first
    assert "must_sample_rule" in r.first and r.named == "greedy_verify" and r.producer_right, r


def test_the_vllm_mutations_name_mapped_functions_of_the_installed_source():
    """Each planted vLLM bug replaces a function the vLLM producer map names, found where the
    replay looks it up (read from the source, not imported: importing vLLM is slow)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed")
    site = Path(spec.origin).resolve().parents[1]
    names = {p.name for p in VLLM}
    assert sum(m.harmless for m in VLLM_MUTATIONS) >= 2 and sum(not m.harmless for m in VLLM_MUTATIONS) >= 6
    for m in VLLM_MUTATIONS:
        assert m.producer in names, m.name
        base = ROOT if m.module.startswith("pcpviz.") else site
        src = (base / (m.module.replace(".", "/") + ".py")).read_text()
        if m.module.startswith("pcpviz."):  # imported there by name from vLLM
            assert f"import InputBatch, {m.attr}" in src or m.attr in src, m.name
        else:  # defined there, or imported there by name (looked up in that module's globals)
            imported = any(isinstance(n, ast.ImportFrom) and m.attr in {a.name for a in n.names}
                           for n in ast.walk(ast.parse(src)))
            assert find_def(ast.parse(src), m.attr) is not None or imported, f"{m.module} has no {m.attr}"


def test_a_mutation_name_means_one_bug():
    """The benchmark's summary tells the engine's rows from vLLM's by name: no name in both."""
    engine, vllm = [m.name for m in MUTATIONS], [m.name for m in VLLM_MUTATIONS]
    assert len(set(engine)) == len(engine) and len(set(vllm)) == len(vllm)
    assert not set(engine) & set(vllm), sorted(set(engine) & set(vllm))
