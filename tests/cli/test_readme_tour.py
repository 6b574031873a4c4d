"""The README's Quick tour, run as written on one CPU machine: every command of its console block
(in a temporary directory, with bash, as a reader would paste it), then its Python block; then
every command that writes (a trace, a JSON or Chrome file) and the Python block again in the same
directory, as a reader repeating the tour would, with the same exit codes. The fault demo must
compare matching runs where the fault visibly costs acceptance: `pcpviz diff` names the injected
fault's view as the first divergence, acceptance at draft position 1 drops, and the numbers the
README quotes are the ones printed. `pcpviz run` prints the engine's time and the command's. The
layout diagram the README shows is the command's output.

The tour holds no GPU or multi-host line; those are in "On GPUs and across hosts". Of those, the
`--write-config` line runs here too (it writes the rank config without starting ranks, on any
machine); the `torchrun --nnodes 2 ... HOST:29500` line needs a second host
(tests/cli/test_cli_run.py runs the same config under torchrun on one host), `vllm serve` GPUs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the README's whole tour, engine runs included

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
TOUR_DOC = (REPO / "docs" / "tour.md").read_text()


def _section(title: str) -> str:
    start = README.index(f"## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end > 0 else None]


def _prose() -> dict[str, str]:
    """The README's Quick tour and docs/tour.md, each as one line of words."""
    return {"README.md": " ".join(_section("Quick tour").split()), "docs/tour.md": " ".join(TOUR_DOC.split())}


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def _join(lines: list[str]) -> list[str]:
    """Commands from lines: each joined with its `\\` continuations."""
    commands: list[str] = []
    for line in lines:
        if commands and commands[-1].split("#")[0].rstrip().endswith("\\"):
            commands[-1] += "\n" + line
        else:
            commands.append(line)
    return commands


def tour_commands() -> list[str]:
    """The console block's commands: `$ ` lines joined with their `\\` continuations."""
    (block,) = _blocks(_section("Quick tour"), "console")
    lines = block.splitlines()
    starts = [i for i, x in enumerate(lines) if x.startswith("$ ")]
    return [_join([lines[i][2:], *lines[i + 1:j]])[0]
            for i, j in zip(starts, starts[1:] + [len(lines)])]


def gpu_commands() -> list[str]:
    """The commands of the "On GPUs and across hosts" section (its bash block, comments left out)."""
    (block,) = _blocks(_section("On GPUs and across hosts"), "bash")
    return _join([x for x in block.splitlines() if x.strip() and not x.lstrip().startswith("#")])


WRITES = ("--trace", "--json", "--chrome", "--write-config", "--overwrite")  # a command with one writes files


def test_the_tour_is_parsed():
    cmds = tour_commands()
    assert cmds[0].startswith("pcpviz layout") and any("--inject" in c for c in cmds)
    assert sum(any(w in c for w in WRITES) for c in cmds) >= 4


def test_the_tour_runs_on_one_cpu_machine_and_the_gpu_lines_are_apart():
    """No tour line needs CUDA, a second host or vLLM on GPUs; those lines are in their own section."""
    tour, gpu = tour_commands(), gpu_commands()
    assert not [c for c in tour if re.search(r"cuda|torchrun|HOST|vllm serve|--nnodes", c)], tour
    assert any(c.startswith("torchrun") and "-m pcpviz.engine.rank_main" in c and "HOST" in c for c in gpu), gpu
    assert any("--device cuda" in c and "--write-config" in c for c in gpu), gpu
    assert any("vllm serve" in c for c in gpu), gpu


def _env() -> dict[str, str]:
    # the pcpviz command of this interpreter's environment, first on PATH
    return dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")


def _bash(cmd: str, work: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", cmd], cwd=work, env=_env(), capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def tour(tmp_path_factory):
    """Run every command, then every command that writes again; returns ({command: first run},
    the directory, {command: second run})."""
    work = tmp_path_factory.mktemp("tour")
    first = {cmd: _bash(cmd, work) for cmd in tour_commands()}
    write_config = [c for c in gpu_commands() if "--write-config" in c]
    first.update({c: _bash(c, work) for c in write_config})
    again = {cmd: _bash(cmd, work) for cmd in first if any(w in cmd for w in WRITES)}
    return first, work, again


def _one(tour, prefix: str):
    runs = [(c, r) for c, r in tour[0].items() if c.startswith(prefix)]
    assert len(runs) == 1, (prefix, list(tour[0]))
    return runs[0][1]


def test_every_tour_command_exits_as_its_comment_says(tour):
    for cmd, r in tour[0].items():
        expected = 1 if cmd.startswith(("pcpviz diff", "pcpviz check runs/bad", "pcpviz explain", "pcpviz bisect",
                                        "pcpviz findings")) else 0
        assert r.returncode == expected, f"{cmd!r} exited {r.returncode}:\n{r.stderr[-2000:]}"
        assert "Traceback" not in r.stderr and "Failed to import" not in r.stdout + r.stderr, cmd


def test_the_tour_runs_again_in_the_same_directory(tour):
    """A reader repeating the tour: every command that writes succeeds again over its own output."""
    assert len(tour[2]) >= 5, list(tour[2])
    for cmd, r in tour[2].items():
        assert r.returncode == tour[0][cmd].returncode == 0, \
            f"{cmd!r} exited {r.returncode} when repeated:\n{r.stderr[-2000:]}"
        assert "Traceback" not in r.stderr, cmd


def test_run_prints_the_engine_time_and_the_command_time(tour):
    for cmd, r in tour[0].items():
        if cmd.startswith("pcpviz run") and "--write-config" not in cmd:
            m = re.search(r"engine (\d+\.\d)s, command (\d+\.\d)s", r.stdout)
            assert m, f"{cmd!r}: no 'engine X s, command Y s' in:\n{r.stdout[-500:]}"
            assert float(m.group(1)) <= float(m.group(2)), m.group(0)


def test_the_fault_demo_compares_matching_runs(tour):
    runs = [c for c in tour[0] if c.startswith("pcpviz run") and "--write-config" not in c]
    clean = next(c for c in runs if "--trace runs/demo " in c)
    bad = next(c for c in runs if "--inject" in c)
    assert bad.replace("\\\n", " ").split("--inject")[0].split("--trace")[0] == \
        clean.split("--trace")[0], "the faulty run must repeat the clean run's prompt, PCP and K"
    assert "--inject skip_draft_block_table_gather" in bad


def test_explain_names_the_injected_fault(tour):
    out = _one(tour, "pcpviz explain runs/bad").stdout
    assert "verdict: FAULT: skip_draft_block_table_gather" in out and "confirmed:" in out, out


def test_diff_names_the_injected_faults_view_and_the_acceptance_it_costs(tour):
    diff = _one(tour, "pcpviz diff").stdout
    first = next(line for line in diff.splitlines() if "first divergence:" in line)
    assert "phase draft_1, view block_table_draft" in first, first
    m = re.search(r"position 1: rate \(accepted\)\s+([\d.]+) \(\d+\)\s+([\d.]+) \(\d+\)", diff)
    a, b = float(m.group(1)), float(m.group(2))
    assert b <= a - 0.2, f"the fault should visibly cost acceptance at position 1: {a} -> {b}"
    step, phase, view, rank = re.search(r"first divergence: step (\d+), phase (\S+), view (\S+), rank (\d+)",
                                        first).groups()
    for name, prose in _prose().items():
        assert f"position 1 falls from {a:.2f} to {b:.2f}" in prose, f"{name} quotes other numbers"
        assert f"step {step}, phase `{phase}`, view `{view}`, rank {rank}" in prose, f"{name} points elsewhere"
    check = _one(tour, "pcpviz check runs/bad").stdout
    assert "FAIL  draft_block_tables_global" in check


def test_the_python_block_runs_twice(tour):
    (block,) = _blocks(_section("Quick tour"), "python")
    for attempt in ("first", "second"):
        r = subprocess.run([sys.executable, "-c", block], cwd=tour[1], env=_env(), capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, f"{attempt} run: {r.stderr[-2000:]}"


def test_the_layout_diagram_shown_is_the_commands_output(tour):
    blocks = _blocks(TOUR_DOC, "text")
    layout = _one(tour, "pcpviz layout --pcp 2 --batch p13,d1,d4")
    assert layout.stdout in blocks, "docs/tour.md's layout diagram differs from `pcpviz layout`'s output"


def test_the_planted_bug_is_explained_by_its_mechanism_and_no_fault_is_named(tour):
    """The tour's bug in no catalogue: a planted copy of pcpviz, run as the README says; explain
    gives UNEXPLAINED with the first wrong view, and the README quotes what was printed."""
    plant = _one(tour, "python -m pcpviz.analysis.mutations")
    assert plant.returncode == 0 and "planted draft_prefill_hidden_shifted" in plant.stdout, plant.stderr
    out = _one(tour, "pcpviz explain runs/mystery").stdout
    verdict = next(line for line in out.splitlines() if "verdict:" in line)
    assert "verdict: UNEXPLAINED: first wrong view: step 0, rank 0, phase draft_0, view hidden_in_fp" in verdict, out
    assert "hidden_handoffs" in verdict and "tokens unchanged" in verdict and "not sure of: the cause" in verdict
    assert "FAULT" not in verdict
    runs = {c: r for c, r in tour[0].items() if "pcpviz run" in c and "--write-config" not in c}
    pos0 = {("mystery" if "runs/mystery" in c else "demo" if "runs/demo " in c else "bad"):
            float(re.search(r"acceptance per position \[([\d.]+)", r.stdout).group(1)) for c, r in runs.items()}
    prose = _prose()["docs/tour.md"]
    assert f"acceptance at position 0 falls from {pos0['demo']:.2f} to {pos0['mystery']:.2f}" in prose, pos0
    assert pos0["mystery"] <= pos0["demo"] - 0.3, pos0
