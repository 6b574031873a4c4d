"""The docs live in the repository and stay reachable.

* No tracked file refers to documents outside the repository (the old sibling docs folder, the
  old note it held): every citation points into ``docs/``.
* Every relative Markdown link in README.md and docs/*.md names a file that exists, and every
  ``#anchor`` a heading (GitHub's slug) or an explicit ``<a id=...>`` of that file.
* Every ``docs/<name>.md`` or ``docs/<name>.md#anchor`` mentioned in any tracked text file (code
  docstrings, tests, notebooks) exists, so a citation cannot point at a section that is gone.
* The generated pages (``pcpviz.teaching.docgen``) are up to date and name every check, view and fault.
* docs/module-map.md names every package and module of ``pcpviz/``, each in its package's row.
* README.md is a front door: its picture is in the repository and small, and it carries no
  development history (issue numbers, commit hashes).
* The figures the docs quote from files are those files' figures: the numbers of checks and
  engine faults (docs/module-map.md), the shipped real traces' steps and acceptance (trace and
  vLLM's counter), the engine column of the 2 x H200 table (``data/bench/h200x2.json``'s
  ``derived`` block and the kernel file) and the Workbench timings (docs/figures.md), the
  long-context loss ratios (docs/model.md).
* ``python -m pcpviz.teaching.docgen`` answers bad input with one line.
"""

from __future__ import annotations

import os
import re
import subprocess
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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
    for must in ("README.md", "docs/design.md", "docs/vllm-0.33-pcp-mtp.md", "pcpviz/reference/layout.py",
                 "notebooks/05_vllm.ipynb", "tests/repo/test_docs.py"):
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
    and the fault registry (``pcpviz.teaching.docgen``): regenerate with ``python -m pcpviz.teaching.docgen docs``."""
    from pcpviz.teaching.docgen import PAGES

    stale = [name for name, page in PAGES.items()
             if not (DOCS / name).is_file() or (DOCS / name).read_text(encoding="utf-8") != page()]
    assert not stale, f"regenerate {stale}: python -m pcpviz.teaching.docgen docs"


def test_the_generated_pages_name_every_check_view_and_fault():
    from pcpviz.analysis.checks import CHECKS
    from pcpviz.faults import FAULTS
    from pcpviz.trace.schema import VIEW_SPECS

    checks = (DOCS / "checks-and-faults.md").read_text(encoding="utf-8")
    fmt = (DOCS / "trace-format.md").read_text(encoding="utf-8")
    assert not [n for n in list(CHECKS) + list(FAULTS) if f"`{n}`" not in checks]
    assert not [s.name for s in VIEW_SPECS if f"`{s.name}`" not in fmt]


def _map_rows() -> dict[str, str]:
    """docs/module-map.md's first table: ``pcpviz/NAME/`` or ``pcpviz/NAME.py`` -> its row."""
    rows = {}
    for line in (DOCS / "module-map.md").read_text(encoding="utf-8").splitlines():
        m = re.match(r"^\| `pcpviz/(\w+)(?:/|\.py)` \|(.*)\|$", line)
        if m:
            rows[m.group(1)] = m.group(2)
    return rows


def _public(path: Path) -> list[str]:
    """The modules and packages directly under ``path`` (no underscore names)."""
    return sorted(p.stem if p.suffix == ".py" else p.name for p in path.iterdir()
                  if not p.name.startswith("_") and (p.suffix == ".py" or (p / "__init__.py").is_file()))


def test_module_map_names_every_package_and_module():
    """docs/module-map.md has one row per package or module of pcpviz, and each package's row names
    every module and subpackage in it (``layout``, ``checks/``, ...)."""
    rows = _map_rows()
    top = _public(ROOT / "pcpviz")
    no_row, no_package = [n for n in top if n not in rows], [n for n in rows if n not in top]
    assert not no_row, f"docs/module-map.md has no row for {no_row}"
    assert not no_package, f"docs/module-map.md has rows for missing {no_package}"
    missing = [f"{pkg}.{name}" for pkg in top if (ROOT / "pcpviz" / pkg).is_dir()
               for name in _public(ROOT / "pcpviz" / pkg)
               if not re.search(rf"`{re.escape(name)}(\.py|/)?[`,( ]", rows[pkg])]
    assert not missing, f"docs/module-map.md's rows leave out {missing}"


def test_module_map_paths_exist():
    """Every ``path/`` or ``file.ext`` the module map names in backticks exists."""
    text = (DOCS / "module-map.md").read_text(encoding="utf-8")
    paths = re.findall(r"`((?:pcpviz|kernels|notebooks|data|benchmarks|tools|docs)/[\w./-]*)`", text)
    assert len(paths) > 10
    assert not [p for p in paths if not (ROOT / p).exists()], [p for p in paths if not (ROOT / p).exists()]


_IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("md", _markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_images_exist_and_are_small(md):
    for target in _IMAGE.findall(_strip_code(md.read_text(encoding="utf-8"))):
        dest = (md.parent / target).resolve()
        assert dest.is_file(), f"{md.name}: image {target} does not exist"
        assert dest.stat().st_size < 300_000, f"{md.name}: image {target} is {dest.stat().st_size} bytes"


def test_readme_is_a_front_door():
    """A picture of the Workbench, the two commands, the tour, where to go next; no development
    history (issue numbers, commit hashes, "since the last ... run")."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert _IMAGE.search(text), "README.md shows no picture"
    for heading in ("## Two commands", "## Quick tour", "## On GPUs and across hosts", "## Where to go next"):
        assert f"\n{heading}\n" in text, heading
    history = re.findall(r"(?i)\bissues? \d+|\bcommit [0-9a-f]{7,40}\b|since the last|#\d{2,}\b", _strip_code(text))
    assert not history, f"README.md carries development history: {history}"
    assert len(text.splitlines()) < 250, "README.md is a front door: move details into docs/"


def test_docgen_command_line(tmp_path, capsys):
    """``python -m pcpviz.teaching.docgen DOCS_DIR`` writes the pages; bad input is one line and exit 2."""
    from pcpviz.teaching.docgen import PAGES, main

    assert main([str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(PAGES)
    assert main(["--help"]) == 0 and "usage" in capsys.readouterr().out
    assert main([str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.strip().endswith("missing: not a directory")
    assert main([]) == 2


# --------------------------------------------------------------------------- quoted figures

def _page(rel: str) -> str:
    """A page's text with its whitespace runs made single spaces."""
    return " ".join((ROOT / rel).read_text(encoding="utf-8").split())


def _json(rel: str) -> dict:
    import json

    return json.loads((ROOT / rel).read_text(encoding="utf-8"))


def test_module_map_counts_match_the_registries():
    from pcpviz.analysis.checks import CHECKS
    from pcpviz.faults import ENGINE, faults_of

    text = _page("docs/module-map.md")
    words = {10: "ten", 11: "eleven", 12: "twelve"}
    assert f"`pcpviz check` ({len(CHECKS)} invariants" in text
    assert f"`pcpviz run --list-faults`; {words.get(len(faults_of(ENGINE)), len(faults_of(ENGINE)))} faults" in text


def test_shipped_real_traces_table_matches_the_traces():
    """Each row of "Shipped real traces": steps, and acceptance per position from the trace and from
    vLLM's own counter in run.json (2 decimals)."""
    import pcpviz.trace as pt
    from pcpviz.analysis.acceptance import acceptance

    rows = re.findall(r"^\| `((?:vllm|vllm-serve)-h200x\d[\w-]*)` \| .*? \| (\d+) \| (.*?) / (.*?) \|$",
                      (DOCS / "figures.md").read_text(encoding="utf-8"), flags=re.M)
    assert len(rows) == len(list((ROOT / "data" / "traces").glob("vllm-*"))), rows
    for name, steps, ours, theirs in rows:
        trace = pt.open(ROOT / "data" / "traces" / name)
        assert int(steps) == len(trace.steps), name
        rates = [float(x) for x in ours.replace("**", "").split(",")]
        assert rates == pytest.approx(acceptance(trace).rate_per_position, abs=0.0051), name
        counter = trace.meta.get("vllm_spec_decode_metrics")
        if counter is None and "flight_recorder" in trace.meta:  # a dump: no counter beside it
            assert theirs.strip() == "-", name
            continue
        if counter is not None:
            rates = counter["acceptance_rate_per_pos"]
        else:  # `vllm serve`: the Prometheus lines scraped after the completions
            lines = trace.meta["serve"]["spec_decode_metrics"]
            value = lambda key: float(next(x for x in lines if key in x).split()[-1])  # noqa: E731
            drafts = value("spec_decode_num_drafts_total")
            rates = [value(f'per_pos_total{{engine="0",model_name="{trace.meta["model"]}",position="{i}"}}') / drafts
                     for i in range(trace.meta["num_speculative_tokens"])]
        assert [float(x) for x in theirs.split(",")] == pytest.approx(rates, abs=0.0051), name


def test_engine_figures_match_the_bench_file():
    """docs/figures.md's 2 x H200 table: its "engine now" column is data/bench/h200x2.json's 'derived' block and its
    kernel summary."""
    d = _json("data/bench/h200x2.json")
    der, ker = d["derived"], _json("data/bench/kernels_h200.json")["kernels"]
    lines = (DOCS / "figures.md").read_text(encoding="utf-8").splitlines()

    def row(start: str) -> str:
        (line,) = [x for x in lines if x.startswith(f"| {start}")]
        return line

    assert f"| {der['prefill_target_ms_pcp1']:.1f} ms |" in row("32k-token prefill step")
    assert f"**{der['prefill_target_ms_pcp2'] / der['prefill_target_ms_pcp1']:.2f}** " \
           f"({der['prefill_target_ms_pcp2']:.1f} ms)" in row("same, PCP=2 / PCP=1")
    assert f"| {der['decode_ms_per_token_k0']:.2f} ms (CUDA graphs, PCP=1)" in row("decode step, batch 1, K=0")
    assert (f"| {der['mtp_decode_speedup_steady']:.2f}x ({der['decode_ms_per_token_k2']:.2f} ms a token, "
            f"{der['tokens_per_decode_step_k2']:.2f} tokens a step)") in row("MTP K=2 over K=0")
    decode = ker["paged_mla_decode_bf16_b16_ctx32768_h16"]
    assert f"{100 * decode['fraction_of_copy_bw']:.1f}%" in row("paged MLA decode")
    pre = ker["mla_prefill_bf16_T32768_pcp1"]
    assert f"{pre['TFLOPS']:.0f} TFLOP/s ({100 * pre['fraction_of_bf16_peak']:.0f}% of bf16 peak)" \
        in row("flash MLA prefill")


def test_workbench_and_long_context_figures_match_their_files():
    wb, lc = _json("data/bench/workbench_cpu.json"), _json("data/bench/long_context.json")["models"]
    text, model = _page("docs/figures.md"), _page("docs/model.md")
    warm, cold = wb["warm"]["overall"], wb["cold"]["overall"]
    assert (f"in {warm['median_ms']:.0f} ms at the median (p90 {warm['p90_ms']:.0f} ms), "
            f"{cold['median_ms']:.0f} ms (p90 {cold['p90_ms']:.0f} ms)") in text
    short = lc["pcpviz-tiny-dsv3"]["by_position"]["summary"]["far_over_short"]
    long_ = lc["pcpviz-tiny-dsv3-long"]["by_position"]["summary"]["far_over_short"]
    assert f"(8k-32k: {short:.2f}x the loss below 2k)" in model and f"8k-32k at {long_:.2f}x the loss below 2k" in model


def test_the_piecewise_findings_evidence_file_holds_the_assertion_it_is_cited_for():
    """docs/findings/piecewise-draft-prefill.md and docs/figures.md cite this file for vLLM's replay-address
    assertion: on both PCP ranks, in the draft prefill's graph replay, 2 of the 12 inputs (0 and 2)
    at other addresses."""
    text = (ROOT / "data" / "findings" / "piecewise-draft-prefill-address-check.txt").read_text(encoding="utf-8")
    for rank in (0, 1):
        lines = [x for x in text.splitlines() if f"Worker_PCP{rank} " in x]
        frames = "\n".join(lines)
        order = ["in sample_tokens", "in propose", "in _prefill", "in _run_model", "in run_pw_graph",
                 "deepseek_mtp.py", "cuda_graph.py\", line 352"]
        at = [frames.find(f) for f in order]
        assert -1 not in at and at == sorted(at), (rank, dict(zip(order, at)))
        (assertion,) = [x for x in lines if "AssertionError: Input addresses for cudagraphs are different" in x]
        expected, got = (re.findall(r"\d+", part) for part in assertion.split("Expected")[1].split("got"))
        assert len(expected) == len(got) == 12
        assert [i for i in range(12) if expected[i] != got[i]] == [0, 2]


def test_one_gpu_engine_figures_match_the_bench_file():
    """docs/figures.md's one-H200 table and the README's: data/bench/h200x1.json's figures."""
    d = _json("data/bench/h200x1.json")
    c, steady = d["compile"], d["decode_steady"]
    lines = (DOCS / "figures.md").read_text(encoding="utf-8").splitlines()

    def row(start: str) -> str:
        (line,) = [x for x in lines if x.startswith(f"| one GPU: {start}")]
        return line

    assert (f"| {steady['k0']['ms_per_step']:.2f} ms ({c['compile1_k0']['ms_per_step']:.2f} compiled, "
            f"{c['compile0_k0']['ms_per_step']:.2f} not, interleaved)") in row("decode step, K=0")
    assert (f"**{c['compile1_mtp_speedup']:.2f}x** compiled, {c['compile0_mtp_speedup']:.2f}x not (`compile`); "
            f"{steady['mtp_speedup']:.2f}x in `decode_steady`") in row("MTP K=2 over K=0, per token, batch 1 ")
    assert f"**{d['prefill_step_ms_pcp1']:.1f} ms**" in row("32k-token prefill step")
    assert f"| {d['recording_overhead']:.2f}x |" in row("recording on / off")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    k2 = c["compile1_k2"]
    assert (f"| {k2['ms_per_step'] / k2['tokens_per_step']:.2f} ({k2['ms_per_step']:.2f} ms a step, "
            f"{k2['tokens_per_step']:.2f} tokens)") in readme
    assert f"| {c['compile1_mtp_speedup']:.2f}× (K=0: {c['compile1_k0']['ms_per_step']:.2f} ms a token)" in readme
    assert f"| {d['prefill_step_ms_pcp1']:.1f} ms (32k tokens)" in readme
    b16 = _json("data/bench/h200x1_mtp_batch16.json")
    b, s = b16["mtp_batch16"], b16["decode_steady"]
    assert (f"| {b['mtp_speedup']:.2f}x ({b['k2']['ms_per_token']:.3f} vs {b['k0']['ms_per_token']:.3f} ms a token; "
            f"batch 1 in the same run: {s['mtp_speedup']:.2f}x;") in row("MTP K=2 over K=0, per token, batch 16")
    assert not b["tokens_equal"] and "| same tokens: K=0 vs K=2 at batch 16 (bf16) | | **no**" in "\n".join(lines)
