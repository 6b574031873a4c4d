"""pcpviz's modules import one way (issue 40): no import circle among them, function-local imports
and a package's lazy ``__getattr__`` imports included, and the layers below do not reach the ones
above: the producers (engine, vLLM plugin and replay, synthetic) and the trace never reach
``pcpviz.analysis``, the views or the command line; the cost model does not reach the command line.

The graph is built from the source with ``ast`` (nothing is imported): an edge ``a -> b`` for every
``import`` / ``from ... import`` statement anywhere in ``a`` that names module ``b`` of pcpviz (``from
p import x`` names ``p.x`` when that is a module, else ``p``). A package's ``__init__`` importing its
own submodules is an edge like any other, so a submodule importing its package back is a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PRODUCERS_AND_TRACE = ("pcpviz.engine", "pcpviz.vllm", "pcpviz.synthetic", "pcpviz.trace", "pcpviz.reference")
ABOVE_THEM = ("pcpviz.analysis", "pcpviz.views", "pcpviz.cli", "pcpviz.teaching")


def _modules(root: Path) -> dict[str, Path]:
    mods = {}
    for p in sorted((root / "pcpviz").rglob("*.py")):
        rel = p.relative_to(root).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        mods[".".join(parts)] = p
    return mods


def _targets(mod: str, path: Path, node: ast.Import | ast.ImportFrom, mods: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:  # relative: from . import x, from ..trace import y
        pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        pkg = pkg[:len(pkg) - node.level + 1]
        base = ".".join(pkg + ([base] if base else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]


def import_graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """``{module: {imported pcpviz module: first line}}`` of every module under ``root/pcpviz``."""
    mods = _modules(root)
    edges: dict[str, dict[str, int]] = {m: {} for m in mods}
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for t in _targets(mod, path, node, mods):
                    while t not in mods and "." in t:  # pcpviz.trace.schema.X -> pcpviz.trace.schema
                        t = t.rsplit(".", 1)[0]
                    if t in mods and t != mod:
                        edges[mod].setdefault(t, node.lineno)
    return edges


def circles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _one_cycle(comp: list[str], edges: dict[str, dict[str, int]]) -> str:
    """One path round the component, with the line of each import: ``a:12 -> b:40 -> a``."""
    members = set(comp)
    path, seen, v = [comp[0]], {comp[0]: 0}, comp[0]
    while True:
        w = min(t for t in edges[v] if t in members)
        path.append(w)
        if w in seen:
            ring = path[seen[w]:]
            return " -> ".join(f"{a}:{edges[a][b]}" for a, b in zip(ring, ring[1:])) + f" -> {ring[-1]}"
        seen[w] = len(path) - 1
        v = w


def _reach(edges: dict[str, dict[str, int]], start: str) -> dict[str, str]:
    """Every module ``start`` reaches, with the module it was reached from."""
    came = {start: ""}
    todo = [start]
    while todo:
        v = todo.pop()
        for w in edges[v]:
            if w not in came:
                came[w] = v
                todo.append(w)
    return came


def _chain(came: dict[str, str], end: str) -> str:
    out = [end]
    while came[out[-1]]:
        out.append(came[out[-1]])
    return " -> ".join(reversed(out))


def test_no_import_circle():
    edges = import_graph()
    assert len(edges) > 150 and "pcpviz.trace.schema" in edges["pcpviz.trace.reader"]
    found = circles(edges)
    assert not found, "import circles (break them; a function-local import does not):\n" + "\n".join(
        _one_cycle(c, edges) for c in found)


def test_the_finder_finds_a_planted_circle(tmp_path):
    # the test can fail: a circle closed only by a function-local import is found and named
    pkg = tmp_path / "pcpviz" / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / "pcpviz" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("from pcpviz.sub.b import g\n\ndef f():\n    return g()\n")
    (pkg / "b.py").write_text("def g():\n    from pcpviz.sub import a\n    return a\n")
    edges = import_graph(tmp_path)
    assert circles(edges) == [["pcpviz.sub.a", "pcpviz.sub.b"]]
    assert _one_cycle(["pcpviz.sub.a", "pcpviz.sub.b"], edges) == "pcpviz.sub.a:1 -> pcpviz.sub.b:2 -> pcpviz.sub.a"


def test_producers_and_the_trace_do_not_reach_the_analysis():
    edges = import_graph()
    bad = []
    for mod in edges:
        if mod.startswith(PRODUCERS_AND_TRACE):
            came = _reach(edges, mod)
            bad += [_chain(came, m) for m in came if m.startswith(ABOVE_THEM)][:1]
    assert not bad, "a producer or the trace reaches a layer above it:\n" + "\n".join(bad)


def test_the_analysis_does_not_reach_the_teaching_the_views_or_the_command_line():
    edges = import_graph()
    above = ("pcpviz.teaching", "pcpviz.views", "pcpviz.cli")
    bad = []
    for mod in edges:
        if mod.startswith("pcpviz.analysis"):
            came = _reach(edges, mod)
            bad += [_chain(came, m) for m in came if m.startswith(above)][:1]
    assert not bad, "the analysis reaches a layer above it:\n" + "\n".join(bad)


def test_the_cost_model_does_not_reach_the_command_line():
    edges = import_graph()
    for mod in edges:
        if mod.startswith("pcpviz.costmodel"):
            came = _reach(edges, mod)
            assert not [m for m in came if m.startswith("pcpviz.cli")], _chain(
                came, next(m for m in came if m.startswith("pcpviz.cli")))
