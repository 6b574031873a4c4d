"""Claims the docs and notebooks make about vLLM 0.33.0 that a review found wrong once, read from their data.

The data is ``docs/review/claims.json`` in the repository (documentation, not part of the
installed library). Each ``CorrectedClaim`` names the files that state it (``REVIEW``: the rendered
review map), a phrase each must contain (``says``, whitespace collapsed), phrases none may contain
any more (``not_says``: the wrong version), and the vLLM lines that show it (``VllmRef``; a test
reads the installed package). ``tests/teaching/test_claims.py`` holds every claim to the files and
to vLLM, and runs the computation behind it where one exists. Rows 1-10 are issue 25's
corrections, rows 11-27 issue 36's (what a dense model hid: the MoE's PCP collectives, the sparse
indexer, the CUDA-graph defaults); row 9, for example::

    >>> c = load_claims()["row 9"]; c.says[0][0], c.vllm[-1].anchor
    ('notebooks/00_quickstart.ipynb', 'if slot_mapping.shape[0] <= local_num_tokens:')
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from pcpviz.teaching.review import VllmRef, review_markdown, vllm_ref

__all__ = ["CorrectedClaim", "CLAIMS_FILE", "load_claims", "REVIEW", "file_text", "normalized"]

CLAIMS_FILE = Path(__file__).resolve().parents[2] / "docs" / "review" / "claims.json"
REVIEW = "REVIEW_MAP"  # not a file: review.review_markdown(), where the review map's rows are read


@dataclass(frozen=True)
class CorrectedClaim:
    claim: str
    says: tuple[tuple[str, str], ...]  # (repo file, phrase it contains)
    not_says: tuple[tuple[str, str], ...]  # (repo file, phrase it no longer contains)
    vllm: tuple[VllmRef, ...]


def _pairs(where: str, rows: object) -> tuple[tuple[str, str], ...]:
    if not isinstance(rows, list) or not all(
            isinstance(r, list) and len(r) == 2 and all(isinstance(x, str) for x in r) for r in rows):
        raise ValueError(f"{where}: expected a list of [file, phrase] pairs")
    return tuple((r[0], r[1]) for r in rows)


@lru_cache(maxsize=4)
def load_claims(path: Path = CLAIMS_FILE) -> dict[str, CorrectedClaim]:
    """``{"row N": CorrectedClaim}`` from the claims' JSON file; ValueError naming the file, the row
    and the key when it is missing or malformed."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
        rows = doc.get("claims") if isinstance(doc, dict) else None
        if not isinstance(rows, dict):
            raise ValueError("claims: expected an object of rows")
        out = {}
        for key, d in rows.items():
            if not isinstance(d, dict) or not isinstance(d.get("claim"), str) or not isinstance(d.get("vllm"), list):
                raise ValueError(f"claims.{key}: expected claim (text) and vllm (a list)")
            out[key] = CorrectedClaim(d["claim"], _pairs(f"claims.{key}.says", d.get("says")),
                                      _pairs(f"claims.{key}.not_says", d.get("not_says")),
                                      tuple(vllm_ref(f"claims.{key}.vllm[{i}]", r) for i, r in enumerate(d["vllm"])))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: {' '.join(str(exc).split())}") from None
    return out


def file_text(root: Path, rel: str) -> str:
    """The text of ``rel`` under ``root``; for a notebook its cells' sources joined; for ``REVIEW``
    the rendered review map."""
    if rel == REVIEW:
        return review_markdown()
    path = root / rel
    if path.suffix == ".ipynb":
        return "\n".join("".join(c["source"]) for c in json.loads(path.read_text(encoding="utf-8"))["cells"])
    return path.read_text(encoding="utf-8")


def normalized(text: str) -> str:
    """Whitespace runs collapsed to one space (a phrase may be wrapped anywhere)."""
    return re.sub(r"\s+", " ", text)
