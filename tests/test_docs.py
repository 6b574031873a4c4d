"""The docs live in the repository and stay reachable.

* No tracked file refers to documents outside the repository (the old sibling docs folder, the
  old note it held): every citation points into ``docs/``.
* Every relative Markdown link in README.md and docs/*.md names a file that exists, and every
  ``#anchor`` a heading (GitHub's slug) or an explicit ``<a id=...>`` of that file.
* Every ``docs/<name>.md`` or ``docs/<name>.md#anchor`` mentioned in any tracked text file (code
  docstrings, tests, notebooks) exists, so a citation cannot point at a section that is gone.
* docs/design.md names every check of ``pcpviz.checks.CHECKS``.
"""

from __future__ import annotations

import os
import re
import subprocess
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# Spelled in pieces so that this file does not match itself.
FORBIDDEN = ("../" + "shared", "shared" + "/docs", "design" + " note")
BINARY_SUFFIXES = (".arrow", ".safetensors", ".png", ".jpg", ".gz", ".xz", ".whl", ".so")
SKIP_DIRS = {".git", ".venv", "node_modules", "__pycache__", "runs", "artifacts", ".gpu"}


def _tracked_files() -> list[Path]:
    """Tracked files and new ones git does not ignore (``git ls-files``); outside a git
    checkout, the tree without build directories."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=ROOT, capture_output=True, check=True).stdout
        names = [n for n in out.decode("utf-8").split("\0") if n]
        if names:
            return [ROOT / n for n in names if (ROOT / n).is_file()]
    except (OSError, subprocess.CalledProcessError):
        pass
    files = []
    for d, dirs, names in os.walk(ROOT):
        dirs[:] = [x for x in dirs if x not in SKIP_DIRS and not x.endswith(".egg-info")]
        files += [Path(d) / n for n in names]
    return files


@lru_cache(maxsize=1)
def _text_files() -> dict[str, str]:
    """Relative path -> text of every tracked text file."""
    out = {}
    for path in _tracked_files():
        if path.suffix in BINARY_SUFFIXES:
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue
        try:
            out[path.relative_to(ROOT).as_posix()] = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
    return out


def test_the_scan_sees_the_repository():
    files = _text_files()
    for must in ("README.md", "docs/design.md", "docs/vllm-0.33-pcp-mtp.md", "pcpviz/layout.py",
                 "notebooks/05_vllm.ipynb", "tests/test_docs.py"):
        assert must in files, must


def test_no_reference_outside_the_repository():
    bad = []
    for rel, text in _text_files().items():
        low = text.lower()
        for phrase in FORBIDDEN:
            i = low.find(phrase)
            if i >= 0:
                line = text.count("\n", 0, i) + 1
                bad.append(f"{rel}:{line}: {phrase!r}")
    assert not bad, "references to documents outside the repo (cite docs/*.md instead):\n" + "\n".join(bad)


# --------------------------------------------------------------------------- anchors

_FENCE = re.compile(r"^(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_EXPLICIT = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def github_slug(heading: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens.

    >>> github_slug("Worked example: Scenario A")
    'worked-example-scenario-a'
    """
    text = re.sub(r"`|\*\*|__", "", heading).strip().lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading keeps its text
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


@lru_cache(maxsize=None)
def anchors(path: Path) -> frozenset[str]:
    """Every anchor a Markdown file defines (headings outside code fences, explicit ids)."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if fenced:
            continue
        out.update(_EXPLICIT.findall(line))
        m = _HEADING.match(line)
        if m:
            slug = github_slug(m.group(2))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return frozenset(out)


def test_github_slug():
    assert github_slug("Dummy, profile and warm-up runs") == "dummy-profile-and-warm-up-runs"
    assert github_slug("Views of the `target` phase") == "views-of-the-target-phase"
    assert github_slug("vLLM 0.33.0: PCP") == "vllm-0330-pcp"


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _strip_code(text: str) -> str:
    """Markdown without fenced code blocks (links there are not links)."""
    out, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return "\n".join(out)


@pytest.mark.parametrize("md", _markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_markdown_links_resolve(md):
    assert md.is_file(), md
    broken = []
    for target in _LINK.findall(_strip_code(md.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        dest = md if not path_part else (md.parent / path_part).resolve()
        if not dest.exists():
            broken.append(f"{target}: {dest} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading or id '{anchor}' in {dest.relative_to(ROOT)}")
    assert not broken, f"{md.relative_to(ROOT)}:\n" + "\n".join(broken)


_DOC_REF = re.compile(r"(?:(?<=[\s`'\"(\[<])|(?<=\.\./)|^)docs/([A-Za-z0-9_.-]+\.md)(?:#([A-Za-z0-9_-]+))?",
                      re.MULTILINE)


def test_docs_citations_in_code_tests_and_notebooks_resolve():
    broken, seen = [], 0
    for rel, text in _text_files().items():
        for m in _DOC_REF.finditer(text):
            seen += 1
            name, anchor = m.group(1), m.group(2)
            dest = DOCS / name
            line = text.count("\n", 0, m.start()) + 1
            if not dest.is_file():
                broken.append(f"{rel}:{line}: docs/{name} does not exist")
            elif anchor and anchor not in anchors(dest):
                broken.append(f"{rel}:{line}: docs/{name} has no section '#{anchor}'")
    assert seen > 10  # the citations this test guards are really found
    assert not broken, "\n".join(broken)


def test_generated_pages_are_up_to_date():
    """docs/trace-format.md and docs/checks-and-faults.md are generated from the schema, the checks
    and the fault registry (``pcpviz.docgen``): regenerate with ``python -m pcpviz.docgen docs``."""
    from pcpviz.docgen import PAGES

    stale = [name for name, page in PAGES.items()
             if not (DOCS / name).is_file() or (DOCS / name).read_text(encoding="utf-8") != page()]
    assert not stale, f"regenerate {stale}: python -m pcpviz.docgen docs"


def test_the_generated_pages_name_every_check_view_and_fault():
    from pcpviz.checks import CHECKS
    from pcpviz.faults import FAULTS
    from pcpviz.trace.schema import VIEW_SPECS

    checks = (DOCS / "checks-and-faults.md").read_text(encoding="utf-8")
    fmt = (DOCS / "trace-format.md").read_text(encoding="utf-8")
    assert not [n for n in list(CHECKS) + list(FAULTS) if f"`{n}`" not in checks]
    assert not [s.name for s in VIEW_SPECS if f"`{s.name}`" not in fmt]


def test_readme_module_map_names_every_module():
    """README's "What is here" names every module and package of pcpviz."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    table = text[text.index("## What is here"):text.index("\n## ", text.index("## What is here") + 1)]
    names = sorted(p.stem if p.suffix == ".py" else p.name for p in (ROOT / "pcpviz").iterdir()
                   if not p.name.startswith("_") and (p.suffix == ".py" or (p / "__init__.py").is_file()))
    missing = [n for n in names if not re.search(rf"`(pcpviz/)?{re.escape(n)}(\.py|/)?[`,]", table)]
    assert not missing, f"README's module map leaves out {missing}"


def test_docgen_command_line(tmp_path, capsys):
    """``python -m pcpviz.docgen DOCS_DIR`` writes the pages; bad input is one line and exit 2."""
    from pcpviz.docgen import PAGES, main

    assert main([str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(PAGES)
    assert main(["--help"]) == 0 and "usage" in capsys.readouterr().out
    assert main([str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.strip().endswith("missing: not a directory")
    assert main([]) == 2
