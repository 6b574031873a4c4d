"""The design review of vLLM #56107 (PCP for single-module MTP and replicated DSpark), read from its data.

The data is ``docs/review/review-map.json`` in the repository (documentation, not part of the
installed library); ``review_map()`` and ``support_cases()`` read it once (a missing
or malformed file is one ``ValueError`` line naming it and the key). The review map has one row per
implementation point, review comment and risk of the PR review,
plus the 0.33.0 details a reviewer needs next to them. Each row names the vLLM 0.33.0 code
(file, line, and a piece of text that line holds — a test reads the installed package to keep
them true), whether pcpviz models it, and the evidence (a check, a fault, a notebook, a test).
``review_markdown()`` renders it for notebook 06; ``support_matrix()`` runs vLLM's own
``PCPManager.validate_config`` over the configurations the review discusses.

Each row also says how far pcpviz went: ``modelled`` (yes / partly / no, and ``how``: pcpviz's
own engine, reference or checks reproduce it), ``demonstrated`` (what ran with vLLM's own code:
the CPU replay, the oracle, a teaching function calling vLLM, or real vLLM on GPUs) and
``only_read`` (what was read in the source and not run). Every risk row fills both.

Evidence vocabulary: ``check:NAME`` (``pcpviz.analysis.checks``), ``fault:NAME``
(``pcpviz.faults``), ``notebook:NN``, ``test:PATH::NAME``, ``teach:NAME`` (a public name of a
``pcpviz.teaching`` module), ``replay:SCENARIO`` (``pcpviz.vllm.replay``), ``finding:NAME``
(``docs/findings/NAME.md``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

__all__ = ["VllmRef", "ReviewPoint", "review_map", "review_markdown", "support_cases", "support_matrix",
           "REVIEW_FILE", "load_review", "vllm_ref"]

REVIEW_FILE = Path(__file__).resolve().parents[2] / "docs" / "review" / "review-map.json"


@dataclass(frozen=True)
class VllmRef:
    path: str  # relative to the vllm package directory
    line: int  # 1-based, in 0.33.0
    anchor: str  # text found on that line

    def __str__(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass(frozen=True)
class ReviewPoint:
    key: str  # "impl 1".."impl 6", "comment 1".."comment 3", "risk 1".."risk 5", "0.33.0: ..."
    point: str
    vllm: tuple[VllmRef, ...]
    modelled: str  # "yes", "partly", "no"
    how: str
    evidence: tuple[str, ...]
    demonstrated: str = ""  # what ran with vLLM's own code (CPU replay, oracle, GPU traces)
    only_read: str = ""  # what was read in vLLM's source and not run


def _field(where: str, row: dict, key: str, kind: type) -> Any:
    value = row.get(key) if isinstance(row, dict) else None
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"{where}: {key}: expected {kind.__name__}, got {type(value).__name__}")
    return value


def vllm_ref(where: str, d: dict) -> VllmRef:
    """A ``VllmRef`` from its JSON object ``{"path", "line", "anchor"}``; ``where`` names it in errors."""
    return VllmRef(_field(where, d, "path", str), _field(where, d, "line", int), _field(where, d, "anchor", str))


def _point(where: str, d: dict) -> ReviewPoint:
    key = _field(where, d, "key", str)
    where = f"{where} ({key})"
    return ReviewPoint(
        key, _field(where, d, "point", str),
        tuple(vllm_ref(f"{where}: vllm[{i}]", r) for i, r in enumerate(_field(where, d, "vllm", list))),
        _field(where, d, "modelled", str), _field(where, d, "how", str),
        tuple(_field(where, {"evidence": e}, "evidence", str) for e in _field(where, d, "evidence", list)),
        demonstrated=d.get("demonstrated", ""), only_read=d.get("only_read", ""))


@lru_cache(maxsize=4)
def load_review(path: Path = REVIEW_FILE) -> tuple[tuple[ReviewPoint, ...], tuple[tuple[str, dict], ...]]:
    """``(review map, support cases)`` from the review's JSON file; ValueError naming the file (and
    the row and key) when it is missing or malformed."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
        points = tuple(_point(f"points[{i}]", d) for i, d in enumerate(_field("review", doc, "points", list)))
        cases = tuple((_field(f"support_cases[{i}]", c, "case", str),
                        dict(_field(f"support_cases[{i}]", c, "config", dict)))
                      for i, c in enumerate(_field("review", doc, "support_cases", list)))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: {' '.join(str(exc).split())}") from None
    return points, cases


def review_map() -> tuple[ReviewPoint, ...]:
    """The review's rows, from ``REVIEW_FILE``."""
    return load_review()[0]


def support_cases() -> tuple[tuple[str, dict], ...]:
    """The configurations the review discusses, ``(name, validate_config keywords)``, from ``REVIEW_FILE``."""
    return load_review()[1]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def review_markdown(points: tuple[ReviewPoint, ...] | None = None) -> str:
    """A markdown table: point, vLLM 0.33.0 code, modelled (and how), demonstrated, only read, evidence
    (of ``points``, default the review map)."""
    points = load_review()[0] if points is None else points
    lines = ["| # | review point | vLLM 0.33.0 | modelled | demonstrated with vLLM's code | only read | evidence |",
             "|---|---|---|---|---|---|---|"]
    for p in points:
        refs = "<br>".join(f"`{r}`" for r in p.vllm) or "—"
        ev = "<br>".join(f"`{e}`" for e in p.evidence)
        lines.append(f"| {p.key} | {_cell(p.point)} | {refs} | **{p.modelled}**: {_cell(p.how)} | "
                     f"{_cell(p.demonstrated) or '—'} | {_cell(p.only_read) or '—'} | {ev} |")
    return "\n".join(lines)


def support_matrix(cases: tuple[tuple[str, dict], ...] | None = None) -> list[tuple[str, str]]:
    """[(case, "accepted" or vLLM's message)] from vLLM 0.33.0's ``PCPManager.validate_config``
    (PCP = 2). ``ParallelConfig`` itself already limits DCP under PCP to {1, PCP, TP*PCP}, so the
    DSpark rule "DCP in {1, PCP}" bites at DCP = TP*PCP. Imports vLLM (``pcpviz.vllm.oracle``)."""
    from pcpviz.vllm.oracle import vllm_validate_config

    out = []
    for name, kw in load_review()[1] if cases is None else cases:
        msg = vllm_validate_config(**{"pcp_size": 2, **kw})
        out.append((name, "accepted" if msg is None else msg))
    return out
