"""pcpviz.trace.meta_model: run.json decoded once into RunMeta (issue 40): structure checked on
decoding, a wrong but well-formed value kept for validate, unknown keys kept in ``extra``."""

from __future__ import annotations

import dataclasses
import json
import pickle
import shutil
from pathlib import Path

import pytest

import pcpviz.trace as pt
from pcpviz.trace.meta_model import META_SCHEMA, LaunchMeta, RunMeta, decode_meta

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted(p.parent for p in (ROOT / "data" / "traces").glob("*/run.json"))
CPU_TRACE = ROOT / "data" / "traces" / "cpu-pcp2-mtp2"


@pytest.mark.parametrize("run_dir", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_run_json_decodes_whole_and_encodes_back(run_dir):
    doc = json.loads((run_dir / "run.json").read_text())
    t = pt.open(run_dir)
    assert t.meta_malformed == ()
    assert t.run_meta.to_json() == doc  # every key kept
    assert dict(t.run_meta.extra) == {}  # every key pcpviz's producers (and tools/gpu) wrote is a field
    assert t.run_meta.recorded == {k for k in doc if k in META_SCHEMA}
    assert t.run_meta.pcp == doc["pcp"] and t.run_meta.kv_block_sizes == tuple(doc.get("block_sizes")
                                                                                or [doc["block_size"]])


def test_the_schema_is_the_fields():
    keyed = [f.name for f in dataclasses.fields(RunMeta) if "check" in f.metadata]
    assert list(META_SCHEMA) == keyed and {"producer", "pcp"} == {k for k, v in META_SCHEMA.items() if v[1]}
    assert all(v[2] for v in META_SCHEMA.values())  # every key says what it means


def test_malformed_keys_keep_their_default_and_are_named_once():
    meta, bad = decode_meta({"producer": "x", "pcp": "2", "dcp": 0, "block_size": 16, "gpus": "H200",
                             "launch": {"sampling": [48]}})
    assert (meta.pcp, meta.dcp, meta.gpus, meta.launch) == (None, 1, (), None)
    assert [k for k, _ in bad] == ["pcp", "dcp", "gpus", "launch"]
    assert dict(bad)["pcp"] == "expected an int in 1..4096, got str '2'"
    assert dict(bad)["launch"].startswith("sampling: expected an object")
    assert decode_meta({"pcp": 2})[1] == (("producer", "required key is missing"),)


def test_a_wrong_but_well_formed_value_decodes_and_fails_its_check(tmp_path):
    d = tmp_path / "t"
    shutil.copytree(CPU_TRACE, d)
    doc = json.loads((d / "run.json").read_text())
    (d / "run.json").write_text(json.dumps({**doc, "pcp": 1}))
    t = pt.open(d)
    assert t.run_meta.pcp == 1 and t.meta_malformed == ()
    st = pt.validate(t)
    assert [p.key for p in st.problems if p.kind == pt.INVALID] == ["pcp"]


def test_unknown_keys_stay_readable_and_nothing_can_be_changed():
    meta, bad = decode_meta({"producer": "x", "pcp": 2, "block_size": 16, "rack": "r7",
                             "my_tool": {"port": 8000, "args": ["--pcp", "2"]}})
    assert bad == () and meta.extra["rack"] == "r7" and meta.extra["my_tool"]["args"] == ("--pcp", "2")
    assert meta.recorded_value("my_tool") == {"port": 8000, "args": ["--pcp", "2"]}
    assert meta.recorded_value("dcp") is None and meta.dcp == 1  # not recorded: its meaning, not a value
    with pytest.raises(dataclasses.FrozenInstanceError):
        meta.pcp = 4  # type: ignore[misc]
    with pytest.raises(TypeError):
        meta.extra["rack"] = "other"  # type: ignore[index]


def test_derived_facts():
    launch = {"llm_kwargs": {"speculative_config": {"rejection_sample_method": "block"}},
              "sampling": {"max_tokens": 48}, "seconds": {"startup": 60.0}}
    meta, _ = decode_meta({"producer": "vllm-plugin", "pcp": 2, "block_size": 16, "launch": launch,
                           "gpus": ["NVIDIA H200", "NVIDIA H200"]})
    assert isinstance(meta.launch, LaunchMeta) and meta.launch.to_json() == launch
    assert (meta.max_tokens, meta.device_text, meta.method, meta.standard_rejection) == (
        48, "2 x NVIDIA H200", "mtp", False)


def test_without_forgets_keys_and_pickles_as_its_document():
    meta = pt.open(CPU_TRACE).run_meta
    less = meta.without({"num_speculative_tokens", "dcp"})
    assert less.num_speculative_tokens is None and "num_speculative_tokens" not in less.recorded
    assert less.pcp == meta.pcp and less.extra == meta.extra
    assert pickle.loads(pickle.dumps(meta)) == meta


def _held_to_the_type(doc: dict) -> None:
    """Every key ``doc`` (a producer's run.json, less the writer's schema version) holds is a
    RunMeta field, well-formed, and encodes back unchanged."""
    meta, bad = decode_meta(doc)
    assert bad == () and dict(meta.extra) == {}, (bad, sorted(meta.extra))
    assert {k: v for k, v in meta.to_json().items() if k != "pcpviz_trace_schema"} == {
        k: v for k, v in doc.items() if v is not None}


@pytest.mark.parametrize("dcp", [1, 2])
def test_the_engine_writes_run_meta_fields_only(dcp):
    from pcpviz.engine.run_config import build_config
    from pcpviz.engine.trace_dir import trace_meta

    cfg = build_config(["def add(a, b):", [256, 100, 101]], pcp=2, num_speculative_tokens=2, dcp=dcp)
    _held_to_the_type({k: v for k, v in trace_meta(cfg).to_json().items() if k != "pcpviz_trace_schema"})


def test_the_synthetic_producer_writes_run_meta_fields_only():
    from pcpviz.synthetic import RequestSpec, generate

    run = generate([RequestSpec("a", 9, 4, 0), RequestSpec("b", 5, 3, 1)], pcp=2, num_speculative_tokens=2)
    _held_to_the_type({k: v for k, v in run.meta.to_json().items() if k != "pcpviz_trace_schema"})


def test_a_producer_encodes_from_the_type_and_a_wrong_key_fails_where_it_is_written():
    import numpy as np

    from pcpviz.trace.meta_model import RunMeta

    meta = RunMeta.build(producer="p", pcp=np.int64(2), block_size=16, inject=("a",), extra={"rack": "r7"})
    assert meta.pcp == 2 and type(meta.pcp) is int and meta.inject == ("a",) and meta.extra["rack"] == "r7"
    assert meta.to_json()["pcpviz_trace_schema"] == 2 and meta.to_json()["rack"] == "r7"
    with pytest.raises(TypeError, match="'pcp_size' is no RunMeta field"):
        RunMeta.build(producer="p", pcp_size=2, block_size=16)
    with pytest.raises(TypeError, match="'pcp' in extra="):
        RunMeta.build(producer="p", block_size=16, extra={"pcp": 2})
    with pytest.raises(ValueError, match="run.json key 'pcp': expected an int"):
        RunMeta.build(producer="p", pcp="2", block_size=16)
    with pytest.raises(ValueError, match="run.json key 'producer': required key is missing"):
        RunMeta.build(pcp=2, block_size=16)
    assert RunMeta.build(producer="p", pcp=2, block_size=16, tp=None).recorded == {"producer", "pcp", "block_size"}
    merged = meta.merged(dcp=2, block_size=32)
    assert (merged.dcp, merged.block_size, merged.pcp, merged.extra["rack"]) == (2, 32, 2, "r7")


def test_the_writer_takes_a_run_meta_and_writes_its_document(tmp_path):
    import json

    import pcpviz.trace as pt
    from pcpviz.trace.meta_model import RunMeta

    meta = RunMeta.build(producer="p", pcp=1, block_size=16, extra={"rack": "r7"})
    pt.write_run_meta(tmp_path, meta)
    assert json.loads((tmp_path / "run.json").read_text()) == meta.to_json()
