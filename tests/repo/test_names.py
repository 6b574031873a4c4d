"""Each name one meaning (issue 40): a module-level constant (an UPPER_CASE name) or a public class
is defined in one module of pcpviz; every other module imports it. Two definitions are allowed
only where they are the same expression (``CPU = torch.device("cpu")``) or one re-exports the
other (``COMPLETION_FILE = S.COMPLETION_FILE``). And no two modules say ``graphs.py`` for different
things (issue 40 found five).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def definitions(root: Path = ROOT) -> dict[str, list[tuple[str, str]]]:
    """``{name: [(file, the value's source or "class")]}`` of pcpviz's module-level constants and
    public classes (re-exports ``X = mod.X`` left out)."""
    out: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for path in sorted((root / "pcpviz").rglob("*.py")):
        rel = str(path.relative_to(root))
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                out[node.name].append((rel, "class"))
                continue
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            else:
                continue
            for t in targets:
                if not (isinstance(t, ast.Name) and t.id.isupper() and not t.id.startswith("_")):
                    continue
                if isinstance(value, ast.Attribute) and value.attr == t.id:
                    continue  # a re-export under the same name
                out[t.id].append((rel, ast.unparse(value)))
    return out


def test_each_name_has_one_meaning():
    defs = definitions()
    assert {f for f, _ in defs["TraceError"]} == {"pcpviz/trace/errors.py"}
    twice = {name: where for name, where in defs.items()
             if len(where) > 1 and (len({v for _, v in where}) > 1 or "class" in {v for _, v in where})}
    assert not twice, "names defined in more than one module (define once, import elsewhere; or rename):\n" + \
        "\n".join(f"{n}: " + "; ".join(f"{f} = {v[:50]}" for f, v in w) for n, w in sorted(twice.items()))


def test_the_names_issue_40_found_are_defined_once():
    defs = definitions()
    for name in ("PHASES", "ENV_TRACE_DIR", "MALFORMED", "LAYOUT_VIEWS", "MAX_RANKS", "SUPPORTED_VLLM_VERSION",
                 "MAX_BLOCK_SIZE", "MAX_WORLD_SIZE"):
        assert len(defs[name]) <= 1, (name, defs[name])
    assert [f for f, _ in defs["Claim"]] == ["pcpviz/trace/owner.py"]  # the teaching's is CorrectedClaim


def test_one_graphs_module():
    graphs = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "pcpviz").rglob("graphs.py"))
    assert graphs == ["pcpviz/vllm/recording/graphs.py"], graphs
