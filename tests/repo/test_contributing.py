"""CONTRIBUTING.md stays true: each recipe is performed on a temporary copy of the package, with
the code blocks taken from CONTRIBUTING.md itself, and what the recipe promises is checked (the
new check runs and is reported, the new view is declared, compared by diff and documented, the
new fault is injectable, caught and passes the registry test, the new panel is drawn by the
Workbench and the HTML export, the producer's trace meets the
contract); every file and name the document mentions exists."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pcpviz import faults as F
from pcpviz.analysis.checks import CHECKS
from tracegen import clean_run

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")


def _section(title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", DOC, flags=re.S | re.M)
    assert m, f"CONTRIBUTING.md has no section '## {title}'"
    return m.group(1)


def _blocks(title: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", _section(title), flags=re.S)


@pytest.fixture()
def copy(tmp_path) -> Path:
    """A copy of the package (and the registry test) to perform a recipe on."""
    shutil.copytree(ROOT / "pcpviz", tmp_path / "pcpviz", ignore=shutil.ignore_patterns("__pycache__"))
    for rel in ("analysis/test_fault_registry.py", "helpers/tracegen.py"):
        (tmp_path / "tests" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / "tests" / rel, tmp_path / "tests" / rel)
    return tmp_path


def _insert(path: Path, anchor: str, text: str, *, before: bool = False) -> None:
    src = path.read_text(encoding="utf-8")
    assert src.count(anchor) == 1, f"{path.name}: the recipe's anchor {anchor!r} is not found once"
    i = src.index(anchor) + (0 if before else len(anchor))
    path.write_text(src[:i] + text + src[i:], encoding="utf-8")


def _python(copy: Path, script: str) -> dict:
    env = {"PYTHONPATH": f"{copy}:{ROOT / 'kernels'}", "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                       cwd=copy, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _pytest(copy: Path, *args: str) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": f"{copy}:{copy / 'tests' / 'helpers'}:{ROOT / 'kernels'}", "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "--noconftest", "-p", "no:cacheprovider",
                           "tests/analysis/test_fault_registry.py", *args], capture_output=True, text=True, cwd=copy,
                          env=env, timeout=300)


def test_add_a_check(copy):
    (block,) = _blocks("Add a check")
    name = re.search(r'@check\("(\w+)"', block).group(1)
    assert name not in CHECKS
    path = copy / "pcpviz/analysis/checks/step_checks.py"
    path.write_text(path.read_text(encoding="utf-8") + "\n\n" + block, encoding="utf-8")
    out = _python(copy, f"""
        import json, tempfile
        from pathlib import Path
        from pcpviz.analysis.checks import CHECKS, run_checks
        from pcpviz.teaching.docgen import checks_and_faults_markdown
        from pcpviz.synthetic import RequestSpec, generate
        d = Path(tempfile.mkdtemp())
        run = generate([RequestSpec("a", 20, 12), RequestSpec("b", 9, 10)], pcp=2, num_speculative_tokens=2)
        good = run_checks(run.write(d / "good"))
        step, per_rank = run.steps[-1]
        for phases in per_rank:
            phases["verify"]["num_accepted"] = phases["verify"]["num_accepted"] + 5
        bad = run_checks(run.write(d / "bad"))
        print(json.dumps(dict(last=list(CHECKS)[-1], good=good["{name}"].verdict, bad=bad["{name}"].verdict,
                              step=bad["{name}"].first_violation.step, last_step=step,
                              documented="`{name}`" in checks_and_faults_markdown())))
    """)
    assert out == dict(last=name, good="pass", bad="fail", step=out["last_step"], last_step=out["last_step"],
                       documented=True)


def test_add_a_view(copy):
    (block,) = _blocks("Add a view")
    name = re.search(r'\("(\w+)"', block).group(1)
    _insert(copy / "pcpviz/trace/view_specs.py", '    _specs("global batch", (_T,), [\n', block)
    out = _python(copy, f"""
        import json, tempfile
        from pathlib import Path
        import numpy as np
        import pcpviz.trace as pt
        from pcpviz.analysis.diff import diff_traces
        from pcpviz.teaching.docgen import trace_format_markdown
        from pcpviz.synthetic import RequestSpec, generate
        from pcpviz.trace.schema import view_panel, view_spec
        from pcpviz.trace.validate import undeclared_views
        d = Path(tempfile.mkdtemp())
        def run(bump):
            r = generate([RequestSpec("a", 20, 8), RequestSpec("b", 9, 6)], pcp=2, num_speculative_tokens=2)
            for i, (step, per_rank) in enumerate(r.steps):
                for phases in per_rank:
                    t = phases["target"]
                    n = int(t["num_scheduled_tokens"][t["is_prefilling"]].sum()) + (bump if i == 1 else 0)
                    phases["target"]["{name}"] = np.array(n, dtype=np.int64)
            return pt.open(r.write(d / str(bump)))
        a, b = run(0), run(1)
        first = diff_traces(a, b).first
        print(json.dumps(dict(declared=view_spec("target", "{name}") is not None, undeclared=undeclared_views(a),
                              diff=[first.step, first.phase, first.view], panel=view_panel("{name}"),
                              documented="`{name}`" in trace_format_markdown())))
    """)
    assert out["declared"] and out["undeclared"] == [] and out["documented"]
    assert out["diff"][1:] == ["target", name] and out["panel"] == "timeline"


@pytest.mark.slow
def test_add_a_fault(copy):
    decl, switch = _blocks("Add a fault")
    name = re.search(r'fault\(\s*"(\w+)"', decl).group(1)
    assert name not in F.FAULTS
    _insert(copy / "pcpviz/faults.py", "\n\ndef faults_of(", "\n\n" + decl.rstrip("\n"), before=True)
    # the declaration alone: the registry test names the missing switch
    r = _pytest(copy, "-k", "switches")
    assert r.returncode == 1 and "declares faults it has no switch for" in r.stdout, r.stdout[-2000:]
    _insert(copy / "pcpviz/synthetic/phases.py", "    return phases\n\n\ndef add_timestamps(", switch, before=True)
    r = _pytest(copy)
    assert r.returncode == 0, r.stdout[-3000:]
    out = _python(copy, f"""
        import json, tempfile
        from pathlib import Path
        from pcpviz import faults as F
        from pcpviz.analysis.checks import run_checks
        from pcpviz.teaching.docgen import checks_and_faults_markdown
        from pcpviz.synthetic import RequestSpec, generate
        run = generate([RequestSpec("a", 20, 12), RequestSpec("b", 9, 10)], pcp=2, num_speculative_tokens=2,
                       faults=["{name}"])
        report = run_checks(run.write(Path(tempfile.mkdtemp()) / "t"))
        print(json.dumps(dict(caught=F.FAULTS["{name}"].caught_by in report.failed, inject=list(run.meta.inject),
                              synthetic="{name}" in F.faults_of(F.SYNTHETIC),
                              documented="`{name}`" in checks_and_faults_markdown())))
    """)
    assert out == dict(caught=True, inject=[name], synthetic=True, documented=True)


@pytest.mark.slow
def test_add_a_panel(copy):
    (block,) = _blocks("Add a panel")
    name = re.search(r'@panel\("(\w+)"', block).group(1)
    path = copy / "pcpviz/views/panels.py"
    path.write_text(path.read_text(encoding="utf-8") + "\n\n" + block, encoding="utf-8")
    out = _python(copy, f"""
        import json, tempfile
        from pathlib import Path
        import pcpviz.trace as pt
        from pcpviz.synthetic import RequestSpec, generate
        from pcpviz.views.export.html import embedded_data, export_html
        from pcpviz.views.widgets.workbench import AFFECTS, Workbench
        d = Path(tempfile.mkdtemp())
        t = pt.open(generate([RequestSpec("a", 20, 6), RequestSpec("b", 9, 5)], pcp=2,
                             num_speculative_tokens=2).write(d / "t"))
        wb = Workbench(t, step=0, rank=1, checks=False)
        drawn = list(wb.figures["{name}"].data[0].y)
        wb.set(step=1)
        page = Path(export_html(t, d / "r.html", checks=False)).read_text()
        data = embedded_data(page)
        print(json.dumps(dict(
            workbench=drawn == t.record(0, 1, "target")["positions"].tolist(),
            moved=list(wb.figures["{name}"].data[0].y) == t.record(1, 1, "target")["positions"].tolist(),
            affects=sorted(c for c, names in AFFECTS.items() if "{name}" in names),
            exported=data["figs"]["0,1"]["{name}"]["data"][0]["y"] == t.record(0, 1, "target")["positions"].tolist(),
            listed="{name}" in data["views"], titled="Positions — the position" in page)))
    """)
    assert out == dict(workbench=True, moved=True, affects=["rank", "step"], exported=True, listed=True,
                       titled=True)


def test_add_a_producer(tmp_path):
    from pcpviz.analysis.checks import run_checks
    from pcpviz.trace import open as open_trace
    from pcpviz.trace import validate
    from pcpviz.trace.validate import undeclared_views

    (block,) = _blocks("Add a producer")
    ns: dict = {}
    exec(compile(block, "CONTRIBUTING.md", "exec"), ns)  # noqa: S102 - the recipe's own code
    run = clean_run(2)
    trace = open_trace(ns["write_trace"](tmp_path / "t", run.steps, pcp=2, block_size=4, k=3))
    assert trace.meta["producer"] == "my-producer"
    assert validate(trace).ok and undeclared_views(trace) == []
    report = run_checks(trace)
    assert report.ok, report.format()


# --------------------------------------------------------------------------- what the document names

DEFINED_IN = {  # a name CONTRIBUTING.md mentions -> the file that defines it
    "check": "pcpviz/analysis/checks/context.py", "CHECK_MODULES": "pcpviz/analysis/checks/runner.py",
    "VIEW_SPECS": "pcpviz/trace/view_specs.py", "_specs": "pcpviz/trace/view_specs.py",
    "undeclared_views": "pcpviz/trace/validate.py", "fault": "pcpviz/faults.py",
    "PRODUCERS": "pcpviz/faults.py", "PRODUCER_MODULES": "pcpviz/faults.py", "ENGINE": "pcpviz/faults.py",
    "SYNTHETIC": "pcpviz/faults.py", "RULES": "pcpviz/analysis/explain/rules.py",
    "rank_phases": "pcpviz/synthetic/phases.py", "PANELS": "pcpviz/views/panels.py",
    "PanelInput": "pcpviz/views/panels.py", "drawn": "pcpviz/views/figures/violations.py",
    "CASES": "tests/analysis/test_checks.py", "clean_run": "tests/helpers/tracegen.py",
    "corrupt": "tests/helpers/tracegen.py",
}


def test_every_file_and_name_mentioned_exists():
    import importlib

    spans = re.findall(r"`([^`\n]+)`", DOC)
    paths = {s.rstrip("/") for s in spans if re.fullmatch(r"[\w./-]+/[\w.-]*", s) and not s.startswith("http")}
    assert paths and not [p for p in paths if not (ROOT / p).exists()]
    dotted = {re.match(r"pcpviz(\.\w+)+", s).group(0) for s in spans if re.match(r"pcpviz\.\w", s)}
    missing = []
    for d in sorted(dotted):
        parts = d.split(".")
        obj = None
        for i in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                continue
            for attr in parts[i:]:
                obj = getattr(obj, attr, None)
            break
        if obj is None:
            missing.append(d)
    assert dotted and not missing, missing
    for name, rel in DEFINED_IN.items():
        assert re.search(rf"`@?{re.escape(name)}[`(]", DOC), f"CONTRIBUTING.md no longer names {name}"
        src = (ROOT / rel).read_text(encoding="utf-8")
        assert re.search(rf"^\s*(def {name}\(|{name}\s*[:=]|class {name}\b)", src, flags=re.M), (name, rel)
    for module in re.findall(r"python -m ([\w.]+)", DOC):
        assert importlib.util.find_spec(module) is not None, module
