"""The README's Quick tour, run as written: every command of its console block (in a temporary
directory, with bash, as a reader would paste it), then its Python block. The fault demo must
compare matching runs where the fault visibly costs acceptance: `pcpviz diff` names the injected
fault's view as the first divergence, acceptance at draft position 1 drops, and the numbers the
README quotes are the ones printed. The layout diagram the README shows is the command's output.

Left out: the `torchrun --nnodes 2 ... HOST:29500` line, which needs a second host
(tests/cli/test_cli_run.py runs the same config under torchrun on one host).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def _section(title: str) -> str:
    start = README.index(f"## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end > 0 else None]


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def tour_commands() -> list[str]:
    """The console block's commands: `$ ` lines joined with their `\\` continuations."""
    (block,) = _blocks(_section("Quick tour"), "console")
    commands, current = [], None
    for line in block.splitlines():
        if line.startswith("$ "):
            current = line[2:]
            commands.append(current)
        elif current is not None and commands[-1].rstrip().split("#")[0].rstrip().endswith("\\"):
            commands[-1] += "\n" + line
    return commands


def test_the_tour_is_parsed():
    cmds = tour_commands()
    assert cmds[0].startswith("pcpviz layout") and any("--inject" in c for c in cmds)
    assert any(c.startswith("torchrun") and "-m pcpviz.engine.rank_main" in c for c in cmds)


def _env() -> dict[str, str]:
    # the pcpviz command of this interpreter's environment, first on PATH
    return dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")


@pytest.fixture(scope="module")
def tour(tmp_path_factory):
    """Run every command; returns {command: CompletedProcess} and the directory."""
    work = tmp_path_factory.mktemp("tour")
    out = {}
    for cmd in tour_commands():
        if cmd.startswith("torchrun"):
            continue  # needs a second host (see the module docstring)
        out[cmd] = subprocess.run(["bash", "-c", cmd], cwd=work, env=_env(), capture_output=True, text=True,
                                  timeout=600)
    return out, work


def _one(tour, prefix: str):
    runs = [(c, r) for c, r in tour[0].items() if c.startswith(prefix)]
    assert len(runs) == 1, (prefix, list(tour[0]))
    return runs[0][1]


def test_every_tour_command_exits_as_its_comment_says(tour):
    for cmd, r in tour[0].items():
        expected = 1 if cmd.startswith(("pcpviz diff", "pcpviz check runs/bad", "pcpviz explain")) else 0
        assert r.returncode == expected, f"{cmd!r} exited {r.returncode}:\n{r.stderr[-2000:]}"
        assert "Traceback" not in r.stderr and "Failed to import" not in r.stdout + r.stderr, cmd


def test_the_fault_demo_compares_matching_runs(tour):
    runs = [c for c in tour[0] if c.startswith("pcpviz run") and "--write-config" not in c]
    clean, bad = runs
    assert bad.replace("\\\n", " ").split("--inject")[0].split("--trace")[0] == \
        clean.split("--trace")[0], "the faulty run must repeat the clean run's prompt, PCP and K"
    assert "--inject skip_draft_block_table_gather" in bad


def test_explain_names_the_injected_fault(tour):
    out = _one(tour, "pcpviz explain").stdout
    assert "verdict: FAULT: most likely skip_draft_block_table_gather" in out, out


def test_diff_names_the_injected_faults_view_and_the_acceptance_it_costs(tour):
    diff = _one(tour, "pcpviz diff").stdout
    first = next(line for line in diff.splitlines() if "first divergence:" in line)
    assert "phase draft_1, view block_table_draft" in first, first
    m = re.search(r"position 1: rate \(accepted\)\s+([\d.]+) \(\d+\)\s+([\d.]+) \(\d+\)", diff)
    a, b = float(m.group(1)), float(m.group(2))
    assert b <= a - 0.2, f"the fault should visibly cost acceptance at position 1: {a} -> {b}"
    prose = " ".join(_section("Quick tour").split())
    assert f"position 1 falls from {a:.2f} to {b:.2f}" in prose, "the README quotes other numbers"
    step, phase, view, rank = re.search(r"first divergence: step (\d+), phase (\S+), view (\S+), rank (\d+)",
                                        first).groups()
    assert f"step {step}, phase `{phase}`, view `{view}`, rank {rank}" in prose, "the README points elsewhere"
    check = _one(tour, "pcpviz check runs/bad").stdout
    assert "FAIL  draft_block_tables_global" in check


def test_the_python_block_runs(tour):
    (block,) = _blocks(_section("Quick tour"), "python")
    r = subprocess.run([sys.executable, "-c", block], cwd=tour[1], env=_env(), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_layout_diagram_shown_is_the_commands_output(tour):
    blocks = _blocks(_section("Quick tour"), "text")
    layout = _one(tour, "pcpviz layout --pcp 2 --batch p13,d1,d4")
    assert layout.stdout in blocks, "README's layout diagram differs from `pcpviz layout`'s output"
