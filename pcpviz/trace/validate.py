"""Is this trace whole and does its run.json tell the truth? ``validate(trace) -> TraceStatus``.

The one place that knows what a run.json may hold and what a complete trace looks like; the
``check`` and ``export`` commands, ``pcpviz.analysis.checks.run_checks`` and the Workbench all ask it.
Every problem is one line naming the file and the key (or rank), in one of two kinds:

``invalid``
    run.json breaks its schema (``META_SCHEMA``: type, range, required key) or contradicts
    the recorded data: ``pcp`` vs the rank files, ``num_speculative_tokens`` vs the draft
    phases and the verify width, ``block_size`` vs the slot mappings, ``prompt_token_ids`` vs
    the prompt tokens fed, ``num_steps`` vs the steps. Bad input: the
    CLI exits 2.
``incomplete``
    data was lost or the run did not finish: a rank file run.json promises is missing or
    unreadable (a directory, a device, a dangling link), bytes after a damaged or partial record
    were dropped, a step some rank recorded is missing on another, or the completion record
    (``completion``) is missing, says a rank stopped early (``partial``) or disagrees with its
    file; a live writer still holds the trace. The CLI exits 3.

A PCP=2, K=2 trace whose rank 1 lost its steps after step 15 (a flipped byte in step 16's
index)::

    incomplete: runs/x/rank1.arrow: index checksum mismatch (step_crc32); last complete step:
        step 15; 4096 trailing bytes not read
    incomplete: runs/x/rank1.arrow: rank 1 lacks steps 16-20 that rank 0 recorded

Keys not in ``META_SCHEMA`` are allowed (producers add their own: versions, the command line;
``RunMeta.extra`` keeps them); the known ones are checked wherever a producer wrote them. The
structure checks are ``RunMeta``'s decoding (``meta_model.decode_meta``, once, on open); this
module reports what it found malformed and checks the well-formed values against the data.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from . import schema as S
from .completion import judge
from .errors import TraceError
from .meta_model import META_SCHEMA, RunMeta, decode_meta
from .values import report_malformed

__all__ = ["INVALID", "INCOMPLETE", "Problem", "TraceStatus", "META_SCHEMA", "validate_meta", "meta_problems",
           "validate", "trusted_meta", "undeclared_views"]

INVALID, INCOMPLETE = "invalid", "incomplete"


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a trace: ``kind`` (INVALID or INCOMPLETE), the file, the run.json
    key or rank file concerned, and the one-line message (which starts with the file)."""

    kind: str
    file: str
    key: str | None
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "file": self.file, "key": self.key, "message": self.message}


@dataclass(frozen=True)
class TraceStatus:
    """``validate``'s answer: the problems found (none for a whole, truthful trace)."""

    problems: tuple[Problem, ...] = ()
    ending: str = ""  # how the run ended (``completion.judge``): complete, partial: ..., unfinished, ...

    @property
    def valid(self) -> bool:
        """run.json passes its schema and agrees with the data."""
        return not any(p.kind == INVALID for p in self.problems)

    @property
    def complete(self) -> bool:
        """No data was lost (every promised rank readable, no dropped bytes, no missing steps)."""
        return not any(p.kind == INCOMPLETE for p in self.problems)

    @property
    def ok(self) -> bool:
        return not self.problems

    def lines(self, kind: str | None = None) -> list[str]:
        """``"<kind>: <message>"`` per problem (of ``kind`` only, if given)."""
        return [f"{p.kind}: {p.message}" for p in self.problems if kind is None or p.kind == kind]

    def summary(self) -> str:
        """One line: ``complete`` or what is wrong first and how many problems there are."""
        if not self.problems:
            return "trace complete; run.json valid" + (f" (ending {self.ending})" if self.ending.startswith(
                "not recorded") or "marked" in self.ending else "")
        first = self.problems[0]
        more = f" (and {len(self.problems) - 1} more)" if len(self.problems) > 1 else ""
        head = "INVALID run.json" if first.kind == INVALID else "INCOMPLETE trace"
        return f"{head}: {first.message}{more}"

    def to_dict(self) -> dict[str, Any]:
        return {"valid": self.valid, "complete": self.complete, "ending": self.ending,
                "problems": [p.to_dict() for p in self.problems]}


# --------------------------------------------------------------------------- run.json schema

def validate_meta(meta: Any, path: str | Path) -> list[Problem]:
    """The schema problems of a run.json document (``path`` names it in the messages)."""
    path = str(path)
    if not isinstance(meta, dict):
        return [Problem(INVALID, path, None, f"{path}: top level is a {type(meta).__name__}, not an object")]
    return meta_problems(*decode_meta(meta), path)


def meta_problems(meta: RunMeta, malformed: tuple[tuple[str, str], ...], path: str | Path) -> list[Problem]:
    """The schema problems of a decoded run.json (``decode_meta``'s pair): each malformed key, and
    what the keys say together (one of ``block_size`` / ``block_sizes``, which agree; ``dcp_rank``
    a rank of ``dcp``)."""
    path = str(path)
    out = [Problem(INVALID, path, key, f"{path}: {key}: {why}") for key, why in malformed]

    def bad(key: str, what: str) -> None:
        out.append(Problem(INVALID, path, key, f"{path}: {key}: {what}"))

    if not {"block_size", "block_sizes"} & (meta.recorded | {k for k, _ in malformed}):
        bad("block_size", "required key is missing (nor is there block_sizes)")
    if meta.block_sizes and meta.block_size is not None and meta.block_sizes[0] != meta.block_size:
        bad("block_size", f"{meta.block_size} differs from block_sizes[0] = {meta.block_sizes[0]}")
    if "dcp" in meta.recorded and "dcp_rank" in meta.recorded and not 0 <= meta.dcp_rank < meta.dcp:
        bad("dcp_rank", f"{meta.dcp_rank} is not a rank of dcp={meta.dcp}")
    return out


def _decoded(trace: Any, path: Path) -> tuple[RunMeta, list[Problem]]:
    """The trace's decoded run.json (``Trace.run_meta``, decoded once on open) and its schema
    problems; a trace-like object without one has its ``meta`` decoded here."""
    if hasattr(trace, "run_meta"):
        return trace.run_meta, meta_problems(trace.run_meta, trace.meta_malformed, path)
    if not isinstance(trace.meta, dict):
        return RunMeta(), validate_meta(trace.meta, path)
    meta, malformed = decode_meta(trace.meta)
    return meta, meta_problems(meta, malformed, path)


# --------------------------------------------------------------------------- the data

def _steps_text(steps: list[int]) -> str:
    from .reader import steps_summary

    return steps_summary(sorted(steps))


def validate(trace: Any) -> TraceStatus:
    """Check ``trace`` (a ``pcpviz.trace.Trace``): run.json's schema, run.json against the data,
    and completeness (see the module doc). Reads only the index, plus the payloads of one step
    for the block-size check; a payload failing its crc32 there raises ``TraceError``."""
    meta_path = Path(trace.path) / S.RUN_META_FILE
    mp = str(meta_path)
    meta, problems = _decoded(trace, meta_path)
    files = dict(trace.files)
    unreadable = dict(getattr(trace, "unreadable", {}) or {})
    present = set(files) | set(unreadable)

    def invalid(key: str, what: str) -> None:
        problems.append(Problem(INVALID, mp, key, f"{mp}: {key}: {what}"))

    def incomplete(file: Path | str, key: str | None, message: str) -> None:
        problems.append(Problem(INCOMPLETE, str(file), key, message))

    # pcp vs the rank files
    pcp = meta.pcp
    if pcp is not None:
        extra = sorted(r for r in present if r >= pcp)
        if extra:
            names = ", ".join(S.rank_file_name(r) for r in extra[:3])
            invalid("pcp", f"{pcp}, but the directory also holds {names} (a file of another run?)")
        for r in range(pcp):
            if r not in present:
                incomplete(Path(trace.path) / S.rank_file_name(r), f"rank {r}",
                           f"{Path(trace.path) / S.rank_file_name(r)}: missing (run.json says pcp={pcp})")
    for r in sorted(unreadable):
        incomplete(unreadable[r].split(": ", 1)[0], f"rank {r}", unreadable[r])
    # bytes dropped after damage or a partial step; a file cut before its schema header (empty)
    for r, info in sorted(files.items()):
        note = next((w for w in trace.warnings if w.startswith(f"{info.path}:")), None)
        if info.good_bytes < info.size or note is not None:
            incomplete(info.path, f"rank {r}", note or f"{info.path}: {info.size - info.good_bytes} "
                       "trailing bytes not read")
    # steps per rank
    all_steps = set(trace.steps)
    for r, info in sorted(files.items()):
        lacking = sorted(all_steps - set(info.steps))
        if lacking:
            holder = min(q for q in files if set(lacking) & set(files[q].steps))
            incomplete(info.path, f"rank {r}", f"{info.path}: rank {r} lacks steps "
                       f"{_steps_text(lacking)} that rank {holder} recorded")
    num_steps = meta.num_steps
    if num_steps is not None and files and len(all_steps) != num_steps:
        if len(all_steps) < num_steps:
            incomplete(meta_path, "num_steps", f"{mp}: num_steps: {num_steps}, but the rank files "
                       f"hold {len(all_steps)} steps")
        else:
            invalid("num_steps", f"{num_steps}, but the rank files hold {len(all_steps)} steps")
    report_malformed(trace, incomplete)  # inf, NaN or 2.5 in an integer view: damaged data
    ending, ended = judge(trace, pcp)  # how the run ended (pcpviz.trace.completion)
    problems += [Problem(INCOMPLETE, file, key, message) for file, key, message in ended]
    _check_drafts(trace, meta, {p.key for p in problems if p.key}, invalid)
    _check_block_size(trace, meta, invalid)
    _check_prompts(trace, meta, invalid)
    return TraceStatus(tuple(problems), ending)


_SEQUENTIAL_DRAFTERS = frozenset({"mtp", "deepseek_mtp", "eagle", "eagle3"})


def _check_drafts(trace: Any, meta: RunMeta, malformed: set[str], invalid: Callable[[str, str], None]) -> None:
    """num_speculative_tokens K against the data: the verify outcome is K+1 wide
    (``sampled_token_ids`` [R, K+1]); a sequential drafter (MTP, EAGLE) records draft_0 ..
    draft_{K-1}, a parallel one (dspark) fewer, never more."""
    k = meta.num_speculative_tokens
    highest, where = _highest_draft(trace)
    if highest >= 0 and "num_speculative_tokens" not in meta.recorded | malformed:
        invalid("num_speculative_tokens", f"missing, but step {where[0]} rank {where[1]} records "
                f"draft_{highest}")
        return
    if k is None:
        return
    method = meta.method
    if highest >= k or (highest >= 0 and method in _SEQUENTIAL_DRAFTERS and highest + 1 != k):
        invalid("num_speculative_tokens", f"{k}, but the trace records draft phases up to "
                f"draft_{highest} (step {where[0]} rank {where[1]}), i.e. K={highest + 1}")
        return
    # vLLM sizes sampled_token_ids to 1 + the most drafts any request of the step verifies (a
    # step of prefills only is 1 wide); the engine pads to K + 1. Either way never wider.
    for r in trace.ranks[:1]:
        found = _too_wide(trace, r, trace.rank_steps(r), k)
        if found is not None:
            step, width = found
            invalid("num_speculative_tokens", f"{k}, but step {step} rank {r} samples "
                    f"{width[1]} tokens per request (verify sampled_token_ids "
                    f"{list(width)}), i.e. K={width[1] - 1}")
            return


def _too_wide(trace: Any, r: int, steps: list[int], k: int) -> tuple[int, tuple[int, ...]] | None:
    """The first of ``steps`` whose verify ``sampled_token_ids`` on rank ``r`` is wider than
    ``k + 1``, and that shape; None if none is. Read from the steps' index (``Trace.view_shape``:
    no payload), or, for a trace without one, from its records."""
    shape_of = getattr(trace, "view_shape", None)
    for step in steps:
        if not trace.has(step, r, S.PHASE_VERIFY):
            continue
        if shape_of is not None:
            width = shape_of(step, r, S.PHASE_VERIFY, view="sampled_token_ids")
        else:
            rec = trace.record(step, r, S.PHASE_VERIFY)
            width = np.asarray(rec["sampled_token_ids"]).shape if "sampled_token_ids" in rec else None
        if width is not None and len(width) == 2 and width[0] > 0 and width[1] > k + 1:
            return step, tuple(width)
    return None


def _highest_draft(trace: Any) -> tuple[int, tuple[int, int] | None]:
    """(highest draft_k recorded, its first (step, rank)) over every rank and step, in that
    order; -1 and None without draft phases. An opened trace is read by its index, each
    distinct step layout once (a 100,000-step trace has a handful)."""
    highest, where = -1, None
    index = getattr(trace, "_index", None)
    if index is None:
        for r in trace.ranks:
            for step in trace.rank_steps(r):
                for ph in trace.phases(step, r):
                    i = S.draft_index(ph)
                    if i is not None and i > highest:
                        highest, where = i, (step, r)
        return highest, where
    tops: dict[int, int] = {}  # id(layout) -> its highest draft index (-1: none)
    for r in trace.ranks:
        ix = index[r]
        for i, layout in enumerate(ix.layouts):
            top = tops.get(id(layout))
            if top is None:
                top = tops[id(layout)] = max((S.draft_index(ph) for ph in layout.phases
                                              if S.draft_index(ph) is not None), default=-1)
            if top > highest:
                highest, where = top, (int(ix.steps[i]), r)
    return highest, where


def _check_prompts(trace: Any, meta: RunMeta, invalid: Callable[[str, str], None]) -> None:
    """prompt_token_ids against the data: a prompt token the target forward is fed (rank 0's
    global ``input_ids`` at a position inside the prompt) is that prompt's token there. Requests
    are matched by id: a dict's keys, or for the i-th prompt of a list ``req<i>`` (the engine) or
    ``<i>-<suffix>`` (vLLM's ``LLM.generate``)."""
    prompts = meta.prompt_token_ids
    if not prompts:
        return
    by_id = prompts if isinstance(prompts, Mapping) else {f"req{i}": p for i, p in enumerate(prompts)}
    by_index = {} if isinstance(prompts, Mapping) else dict(enumerate(prompts))
    for r in trace.ranks[:1]:
        for step in trace.rank_steps(r):
            if not trace.has(step, r, S.PHASE_TARGET):
                continue
            rec = trace.record(step, r, S.PHASE_TARGET)
            if not all(v in rec for v in ("req_ids", "positions", "input_ids", "query_start_loc")):
                continue
            ids, pos, qsl = (np.asarray(rec[v]) for v in ("input_ids", "positions", "query_start_loc"))
            rids = np.asarray(rec["req_ids"]).ravel().tolist()
            if (ids.ndim != 1 or pos.shape != ids.shape or qsl.ndim != 1 or len(rids) + 1 != qsl.size
                    or any(a.dtype.kind not in "iu" for a in (ids, pos, qsl))):
                return  # malformed views are the checks' business
            for i, rid in enumerate(rids):
                prompt = by_id.get(str(rid))
                head = str(rid).split("-", 1)[0]
                index = int(head) if head.isdigit() and "-" in str(rid) else (
                    int(str(rid)[3:]) if str(rid).startswith("req") and str(rid)[3:].isdigit() else None)
                if prompt is None and index is not None:
                    prompt = by_index.get(index)
                    if prompt is None and by_index:
                        invalid("prompt_token_ids", f"{len(by_index)} prompts, but step {step} rank {r} serves "
                                f"request {rid} (prompt {index}; the run.json of another run?)")
                        return
                lo, hi = int(qsl[i]), int(qsl[i + 1])
                if prompt is None or not 0 <= lo <= hi <= ids.size:
                    continue
                p = pos[lo:hi].astype(np.int64)
                inside = np.flatnonzero((p >= 0) & (p < len(prompt)))
                if inside.size == 0:
                    continue
                want = np.asarray(prompt, dtype=np.int64)[p[inside]]
                got = ids[lo:hi][inside].astype(np.int64)
                bad = np.flatnonzero(want != got)
                if bad.size:
                    j = int(inside[bad[0]])
                    invalid("prompt_token_ids", f"request {rid}'s prompt has token {int(want[bad[0]])} "
                            f"at position {int(p[j])}, but step {step} rank {r} feeds {int(got[bad[0]])} "
                            "there (the run.json of another run?)")
                    return


def _slots_fit(slots: np.ndarray, pos: np.ndarray, row: np.ndarray, table: np.ndarray, size: int) -> bool:
    """Every real token's slot is ``table[row, pos // size] * size + pos % size``."""
    col = pos // size
    ok = col < table.shape[1]
    if not ok.all():
        return False
    return bool(np.array_equal(table[row, col].astype(np.int64) * size + pos % size, slots))


def _check_block_size(trace: Any, meta: RunMeta, invalid: Callable[[str, str], None]) -> None:
    """block_size(s) against the first step with global slot mappings and block tables: a
    token at position p of request row i sits in slot ``table[i, p // bs] * bs + p % bs``. If
    run.json's size does not fit but another one fits every token, run.json is wrong; if none
    fits, the data is (the checks report that). DCP 1 only; padding rows are skipped.

    PCP=2 with run.json block_size 8 and blocks of 16: token at position 9 of a request whose
    first block is 1 has slot 25 = 1*16 + 9, while block_size 8 expects table[i, 1]*8 + 1.
    """
    sizes, bs = meta.block_sizes, meta.block_size
    if sizes is None and bs is None:
        return
    if meta.dcp != 1:
        return
    key = "block_sizes" if sizes is not None else "block_size"
    sizes = list(sizes) if sizes is not None else [bs]
    for r in trace.ranks[:1]:
        for step in trace.rank_steps(r):
            if not trace.has(step, r, S.PHASE_TARGET):
                continue
            rec = trace.record(step, r, S.PHASE_TARGET)
            if not all(v in rec for v in ("slot_mapping_global", "positions", "query_start_loc",
                                          "block_table_global")):
                continue
            slots, pos = np.asarray(rec["slot_mapping_global"]), np.asarray(rec["positions"])
            qsl, table = np.asarray(rec["query_start_loc"]), np.asarray(rec["block_table_global"])
            if slots.ndim == 1:
                slots = slots[None]
            if table.ndim == 2:
                table = table[None]
            if (slots.ndim != 2 or pos.ndim != 1 or qsl.ndim != 1 or table.ndim != 3
                    or slots.shape != (len(sizes), pos.shape[0]) or table.shape[0] != len(sizes)
                    or qsl.shape[0] != table.shape[1] + 1 or qsl.size < 1 or int(qsl[-1]) != pos.shape[0]
                    or any(a.dtype.kind not in "iu" for a in (slots, pos, qsl, table))
                    or (np.diff(qsl) < 0).any() or (pos < 0).any()):
                return  # malformed views are the checks' business
            pos = pos.astype(np.int64)
            row = np.repeat(np.arange(qsl.shape[0] - 1), np.diff(qsl).astype(np.int64))
            for g, size in enumerate(sizes):
                s = slots[g].astype(np.int64)
                real = s >= 0
                args = (s[real], pos[real], row[real], table[g])
                if _slots_fit(*args, size):
                    continue
                fits = [b for b in (1 << i for i in range(21)) if _slots_fit(*args, b)]
                if fits:
                    name = key if key == "block_size" else f"{key}[{g}]"
                    invalid(name, f"{size}, but step {step} rank {r}'s slot mappings fit block "
                            f"size {fits[0]} (slot = block_table[row, position // bs] * bs + "
                            "position % bs), not it")
                    return
            return


def trusted_meta(meta: RunMeta, status: TraceStatus) -> RunMeta:
    """``meta`` without the keys ``status`` found invalid (``block_size`` and ``block_sizes``
    go together), so nothing downstream computes with a value run.json got wrong."""
    bad = {p.key.split("[")[0] for p in status.problems if p.kind == INVALID and p.key}
    if bad & {"block_size", "block_sizes"}:
        bad |= {"block_size", "block_sizes"}
    return meta.without(bad)


def check_or_raise(trace: Any) -> TraceStatus:
    """``validate``, raising ``TraceError`` with the first INVALID line if run.json is invalid."""
    st = validate(trace)
    bad = [p for p in st.problems if p.kind == INVALID]
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise TraceError(bad[0].message + more)
    return st


def undeclared_views(trace: Any) -> list[str]:
    """Every view of ``trace`` the schema (``schema.VIEW_SPECS``) does not declare for its phase,
    or whose dtype kind or number of axes does not fit the declaration: one line per (phase
    class, view, reason), naming the first rank and step it occurs at. Empty for a trace every
    pcpviz producer writes. Not part of ``validate``: a producer of one's own may store more."""
    seen: dict[tuple[str, str, str], str] = {}
    for rank in trace.ranks:
        for step in trace.rank_steps(rank):
            for phase in trace.phases(step, rank):
                rec = trace.record(step, rank, phase)
                for name in rec.keys():
                    spec = S.view_spec(phase, name)
                    why = "not declared in pcpviz.trace.schema" if spec is None else spec.problem(rec[name])
                    key = (S.phase_class(phase), name, why or "")
                    if why and key not in seen:
                        seen[key] = f"rank {rank} step {step} {phase}/{name}: {why}"
    return list(seen.values())
