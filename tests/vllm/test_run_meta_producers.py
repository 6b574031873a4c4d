"""The vLLM producers write run.json keys that are RunMeta fields (issue 40): the CPU replay's
run.json and what the plugin's recorders learn (``recording.meta``), decoded with nothing
malformed and nothing left over in ``RunMeta.extra``. (The plugin's launcher and the flight
recorder add ``launch``, ``prompts``, ``output_token_ids``, ``vllm_spec_decode_metrics`` and
``flight_recorder``: the shipped traces hold them, tests/trace/test_meta_model.py.)"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

import pcpviz.vllm
from pcpviz.trace.meta_model import decode_meta


def _fields_only(doc: dict) -> None:
    meta, bad = decode_meta(doc)
    assert bad == () and dict(meta.extra) == {}, (bad, sorted(meta.extra))


@pytest.mark.parametrize("scenario, models, graph_mode", [("mixed", "tiny", "NONE"), ("dspark", "scripted", "NONE"),
                                                        ("mixed", "scripted", "PIECEWISE")])
def test_the_replay_writes_run_meta_fields_only(tmp_path, scenario, models, graph_mode):
    pcpviz.vllm.replay(pcp=2, mtp=2, trace_dir=str(tmp_path / "t"), scenario=scenario, models=models,
                       graph_mode=graph_mode)
    doc = json.loads((tmp_path / "t" / "run.json").read_text())
    _fields_only(doc)


def test_the_plugins_recorders_learn_run_meta_fields_only():
    from pcpviz.vllm.recording.meta import environment_meta, speculator_meta

    spec = SimpleNamespace(num_speculative_steps=2, method="mtp")
    _fields_only({"producer": "vllm-plugin", "pcp": 2, "dcp": 1, "block_size": 16, "block_sizes": [16],
                  "shard_decode_requests": True, **environment_meta(), **speculator_meta(spec)})
