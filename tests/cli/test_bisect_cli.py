"""``pcpviz bisect``'s ladder and bad input (no producer runs here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pcpviz.bisect import ladder
from pcpviz.cli.commands import main


def test_the_ladder_changes_one_knob_per_rung():
    rungs, unavailable = ladder("replay", {"pcp": 2, "k": 2, "graph_mode": "PIECEWISE"})
    assert [r.name for r in rungs] == ["pcp=1", "graph_mode=NONE", "graph_mode=FULL_AND_PIECEWISE", "k=1",
                                       "chunked_prefill=False", "decodes=replicated"]
    base = rungs[0].options
    for r in rungs:
        changed = {k for k in base if r.options[k] != base[k]} - {"pcp"}
        assert changed <= {r.knob}
    assert any(u.startswith("prefix_caching") for u in unavailable)
    rungs, unavailable = ladder("engine", {"max_num_batched_tokens": 16}, ["max_num_batched_tokens", "graph_mode"])
    assert [r.name for r in rungs] == ["max_num_batched_tokens=2048"]
    assert unavailable == ["graph_mode (no switch in the engine)"]


@pytest.mark.parametrize("argv, message", [
    (["bisect", "--out", "x", "--knobs", "nope"], "unknown knob 'nope'"),
    (["bisect", "--out", "x", "--producer", "engine", "--graph-mode", "PIECEWISE"],
     "--graph-mode is a replay and vllm knob"),
])
def test_bad_input_is_one_line_exit_2(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_the_vllm_ladder_has_prefix_caching_and_a_budget_vllm_accepts():
    rungs, unavailable = ladder("vllm", {"pcp": 1})
    assert [r.name for r in rungs] == ["pcp=2", "graph_mode=NONE", "graph_mode=PIECEWISE", "k=1",
                                       "max_num_batched_tokens=256", "prefix_caching=True"]
    assert unavailable == []
    assert rungs[0].options["graph_mode"] == "FULL_AND_PIECEWISE"  # vLLM's own default mode is the base


@pytest.mark.parametrize("argv, message", [
    (["bisect", "--out", "x", "--producer", "engine", "--model", "m"],
     "--model and --vllm-args are for --producer vllm"),
    (["bisect", "--out", "x", "--budget", "64"], "--budget and --prompt are for the engine and vllm"),
    (["bisect", "--out", "x", "--producer", "vllm", "--vllm-args", "{oops"], "--vllm-args is not JSON"),
    (["bisect", "--out", "x", "--producer", "vllm", "--vllm-args", "[1]"], "--vllm-args must be a JSON object"),
    (["bisect", "--out", "x", "--producer", "vllm", "--inject", "sample_local_logits"], "inject plants engine faults"),
    (["bisect", "--out", "x", "--producer", "vllm", "--fixes", "nope"], "unknown fix 'nope'"),
    (["bisect", "--out", "x", "--producer", "engine", "--fixes", "all"], "fixes patch vLLM's code"),
])
def test_bad_vllm_options_are_one_line_exit_2(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_vllm_producer_without_gpus_is_one_line_exit_2(capsys, tmp_path, monkeypatch):
    """On a machine without the GPUs (CI), the base rung's preflight refuses: one line naming why."""
    import pcpviz.vllm.launch as launch

    monkeypatch.setattr(launch, "_visible_gpus", lambda: 0)
    monkeypatch.chdir(tmp_path)
    assert main(["bisect", "--producer", "vllm", "--pcp", "1", "--out", "b", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "the base run on vLLM" in err
    assert "GPUs needed" in err or "vLLM is not installed" in err or "needs vLLM" in err


def test_vllm_rungs_reach_vllm_as_its_own_keywords(tmp_path, monkeypatch):
    """Each rung's knob arrives as the vllm.LLM keyword it names (the launch vLLM would get, built by
    ``build_vllm_launch``); vLLM itself cannot run here, so a synthetic trace stands in for its
    recording (the real run: tests/vllm/test_bisect_vllm_gpu.py, GPU tier)."""
    import pcpviz.vllm.launch as launch
    from pcpviz.bisect import bisect
    from pcpviz.synthetic import RequestSpec, generate

    seen, envs = {}, {}

    def fake_run(model, prompts, *, trace_dir, **kw):
        kw.pop("progress")
        built = launch.build_vllm_launch(model, prompts, trace_dir=trace_dir, **kw)
        seen[Path(trace_dir).name] = built.llm_kwargs
        envs[Path(trace_dir).name] = built.env
        accept = 0.2 if built.llm_kwargs["enable_prefix_caching"] else 0.9  # the planted flip
        generate([RequestSpec("a", 20, 12), RequestSpec("b", 30, 12)], pcp=kw["pcp"],
                 num_speculative_tokens=kw["num_speculative_tokens"], accept_prob=accept, seed=3).write(trace_dir)
        return None, []

    monkeypatch.setattr(launch, "run", fake_run)
    report = bisect("vllm", out_dir=tmp_path, base={"pcp": 1}, knobs=["prefix_caching", "max_num_batched_tokens"],
                    fixes="piecewise_draft_prefill")
    assert seen["base"]["enable_prefix_caching"] is False and seen["prefix_caching-True"]["enable_prefix_caching"]
    assert seen["base"]["max_num_batched_tokens"] == 2048
    assert seen["max_num_batched_tokens-256"]["max_num_batched_tokens"] == 256
    assert seen["max_num_batched_tokens-256"]["max_num_seqs"] == 16
    assert seen["base"]["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 2}
    assert all(kw["compilation_config"]["cudagraph_mode"] == "FULL_AND_PIECEWISE" for kw in seen.values())
    assert [r.rung.name for r in report.flips()] == ["prefix_caching=True"]
    assert all(e["PCPVIZ_FIXES"] == "piecewise_draft_prefill" for e in envs.values())  # the plugin applies it
    assert "prefix_caching=True flips" in report.format()
