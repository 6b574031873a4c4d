"""What a new user meets first on the command line: `--help` that shows defaults and reads as
plain text, `python -m pcpviz`, one quiet line per bad input, `replay` without vLLM's kernel
import warning, progress while a long prompt is prefilled, and `--write-config` for ranks on
other hosts."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import pytest

from pcpviz.cli.commands import build_parser, main


def _python_m_pcpviz(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "pcpviz", *args], capture_output=True, text=True,
                          timeout=timeout)


def _subparsers():
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return parser, action.choices


def test_help_shows_every_default_as_plain_text():
    parser, subs = _subparsers()
    assert set(subs) == {"layout", "run", "check", "diff", "export", "replay", "explain", "bisect", "findings",
                         "synth"}
    for name, p in [("pcpviz", parser), *subs.items()]:
        text = p.format_help()
        assert "``" not in text and ":func:" not in text, f"{name} --help shows reST markup"
        assert p.description, f"{name} --help has no description"
        for a in p._actions:
            if a.option_strings and a.default not in (None, False, argparse.SUPPRESS) and not a.required:
                assert f"(default: {a.default})" in " ".join(text.split()), (name, a.dest)
    run_help = " ".join(subs["run"].format_help().split())
    assert "--max-num-batched-tokens MAX_NUM_BATCHED_TOKENS per-step token budget (chunked prefill) " \
           "(default: 2048)" in run_help


def test_python_m_pcpviz_is_the_pcpviz_command():
    r = _python_m_pcpviz("--help")
    assert r.returncode == 0 and "replay" in r.stdout, r.stderr
    r = _python_m_pcpviz("replay", "--help")  # registered after the others: reachable too
    assert r.returncode == 0 and "--scenario" in r.stdout, r.stderr
    r = _python_m_pcpviz("layout", "--pcp", "2", "--batch", "p13,d1,d4")
    assert r.returncode == 0 and "requests: A = row 0 p13" in r.stdout


@pytest.mark.slow
def test_replay_prints_no_vllm_kernel_import_warning(tmp_path):
    r = _python_m_pcpviz("replay", "--pcp", "2", "--mtp", "1", "--scenario", "decode_only", "--quiet",
                         "--trace", str(tmp_path / "r"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Failed to import" not in r.stdout + r.stderr
    assert r.stdout.startswith("replayed "), r.stdout


@pytest.mark.parametrize("prompts", [[""], ["x = 1", ""]])
def test_an_empty_prompt_is_bad_input(prompts, capsys, tmp_path):
    args = ["run", "--quiet"]
    for p in prompts:
        args += ["--prompt", p]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"pcpviz run: prompt {len(prompts) - 1} is empty (prompts count from 0)"]
    f = tmp_path / "p.json"
    f.write_text(json.dumps(prompts))
    assert main(["run", "--quiet", "--prompts-file", str(f)]) == 2
    assert "is empty" in capsys.readouterr().err


def test_write_config_for_gpus_on_other_hosts(tmp_path, capsys):
    """This host has no GPU (the test session hides them); the config is for torchrun on the
    hosts that do."""
    cfg = tmp_path / "run.cfg.json"
    assert main(["run", "--pcp", "4", "--device", "cuda", "--prompt", "x = ", "--trace", str(tmp_path / "t"),
                 "--write-config", str(cfg)]) == 0, capsys.readouterr().err
    doc = json.loads(cfg.read_text())
    assert doc["pcp"] == 4 and doc["device"] == "cuda"
    assert "torchrun --nnodes <hosts>" in capsys.readouterr().out


@pytest.mark.slow
def test_a_long_prompt_shows_prefill_progress(tmp_path):
    """Chunked prefill of a 601-token prompt at 64 tokens a step: the progress bar counts the
    prompt tokens prefilled before the first new token appears."""
    r = _python_m_pcpviz("run", "--pcp", "2", "--mtp", "1", "--prompt", "x" * 600, "--max-new-tokens", "2",
                         "--max-num-batched-tokens", "64")
    assert r.returncode == 0, r.stderr[-2000:]
    seen = {int(m) for m in re.findall(r"prefill (\d+)/601", r.stderr)}
    assert 0 in seen and any(0 < s < 601 for s in seen), r.stderr[-2000:]
