"""Is a vLLM 0.33.0 configuration exposed to pcpviz's findings (``docs/findings/``)? Each finding
is a ``Finding`` with the configuration it needs, read from its mechanism in vLLM's source, and
the opt-in fix that removes it (``pcpviz.vllm.fixes``, named in ``$PCPVIZ_FIXES``). A
configuration is a ``VllmSetup``: from ``vllm.LLM`` keywords, from a trace's run.json (what vLLM
resolved: ``cudagraph_mode`` as it ran), or from the CLI's options (``pcpviz findings``).

vLLM's own gate comes first: ``PCPManager.__init__`` (v1/worker/gpu/pcp_manager.py:176-220) refuses
PCP with a speculator other than single-module MTP or DSpark, and FULL CUDA graphs outside
decode-only routines; a configuration it refuses meets no finding.

PCP=2, MTP K=2, vLLM's default graph mode (FULL_AND_PIECEWISE)::

    >>> [e.verdict for e in exposures(VllmSetup(pcp=2, method="mtp", k=2))]
    ['exposed', 'exposed', 'not exposed']
    >>> [e.finding for e in exposures(VllmSetup(pcp=2, method="mtp", k=2))][2]
    'dspark_dummy_run_block_tables'
    >>> [e.verdict for e in exposures(VllmSetup(pcp=2, method="mtp", k=2, enforce_eager=True))]
    ['not exposed', 'not exposed', 'not exposed']
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pcpviz.trace.meta_model import RunMeta

__all__ = ["VllmSetup", "Finding", "Exposure", "FINDINGS", "ALL_CUDAGRAPH_MODES", "exposures", "vllm_refuses",
           "parse_fixes", "EXPOSED", "NOT_EXPOSED", "FIXED", "REFUSED"]

EXPOSED, NOT_EXPOSED, FIXED, REFUSED = "exposed", "not exposed", "fixed", "vLLM refuses the configuration"
ALL_CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
DEFAULT_GRAPH_MODE = "FULL_AND_PIECEWISE"
"""What vLLM 0.33.0 runs when neither ``cudagraph_mode`` nor ``enforce_eager`` is given (an attention
backend without full-graph support may lower it; a trace's run.json has the mode vLLM resolved)."""


@dataclass(frozen=True)
class VllmSetup:
    """The knobs the findings depend on."""

    pcp: int
    method: str  # speculative_config.method: "mtp", "dspark", "eagle", ...
    k: int  # num_speculative_tokens
    cudagraph_mode: str = DEFAULT_GRAPH_MODE
    enforce_eager: bool = False
    multi_module_mtp: bool = False
    fixes: tuple[str, ...] = ()  # pcpviz.vllm.fixes active ($PCPVIZ_FIXES)

    @property
    def graph_mode(self) -> str:
        """The mode vLLM runs: NONE under ``enforce_eager``."""
        return "NONE" if self.enforce_eager else self.cudagraph_mode

    @classmethod
    def from_llm_kwargs(cls, kw: Mapping[str, Any], *, fixes: tuple[str, ...] = ()) -> VllmSetup:
        """From ``vllm.LLM`` keywords (what ``pcpviz.vllm.run`` and ``vllm serve``'s flags set).
        ValueError (one line, naming the keyword) for a value of the wrong kind."""
        spec = kw.get("speculative_config") or {}
        comp = kw.get("compilation_config") or {}
        if not isinstance(spec, Mapping) or not isinstance(comp, Mapping):
            raise ValueError("speculative_config and compilation_config must be JSON objects")
        mode = str(comp.get("cudagraph_mode") or DEFAULT_GRAPH_MODE).upper()
        pcp = kw.get("prefill_context_parallel_size", 1)
        k = spec.get("num_speculative_tokens", 0)
        for name, v in (("prefill_context_parallel_size", pcp), ("num_speculative_tokens", k)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be a non-negative int, got {v!r}")
        return cls(pcp=pcp, method=str(spec.get("method", "")), k=k, cudagraph_mode=mode,
                   enforce_eager=bool(kw.get("enforce_eager", False)), fixes=fixes)

    @classmethod
    def from_meta(cls, meta: RunMeta) -> VllmSetup:
        """From a trace's run.json (``Trace.run_meta``): the mode vLLM resolved, the fixes the
        plugin applied; a key not recorded means PCP 1, MTP, K 0, NONE, no fix."""
        return cls(pcp=meta.pcp or 1, method=meta.method, k=meta.num_speculative_tokens or 0,
                   cudagraph_mode=(meta.cudagraph_mode or "NONE").upper(), fixes=meta.vllm_fixes)


def vllm_refuses(s: VllmSetup) -> str | None:
    """vLLM 0.33.0's own refusal of a PCP configuration (``PCPManager.__init__``), or None."""
    if s.graph_mode not in ALL_CUDAGRAPH_MODES:
        return f"cudagraph_mode {s.graph_mode!r} is not one of {', '.join(ALL_CUDAGRAPH_MODES)}"
    if s.pcp <= 1:
        return None
    if s.k > 0 and s.method != "dspark" and (s.method != "mtp" or s.multi_module_mtp):
        return ("MRV2 PCP only supports DSpark or single-module MTP speculative decoding "
                "(v1/worker/gpu/pcp_manager.py:188-195)")
    if s.graph_mode == "FULL":
        return ("MRV2 PCP supports full CUDA graphs for decode-only routines: FULL_DECODE_ONLY, "
                "FULL_AND_PIECEWISE, PIECEWISE or NONE (v1/worker/gpu/pcp_manager.py:213-220)")
    return None


@dataclass(frozen=True)
class Finding:
    name: str  # as in pcpviz.vllm.fixes.FIXES
    doc: str  # docs/findings/<doc>
    needs: Callable[[VllmSetup], str | None]  # why the setup meets its preconditions, None if not
    when: str  # what must also happen at run time


@dataclass(frozen=True)
class Exposure:
    finding: str
    doc: str
    verdict: str  # EXPOSED | NOT_EXPOSED | FIXED | REFUSED
    why: str
    when: str

    def lines(self) -> list[str]:
        """The verdict, its reason, and for an exposure what must also happen at run time."""
        out = [f"{self.finding:30s} {self.verdict.upper():12s} docs/findings/{self.doc}", f"    why:  {self.why}"]
        return out + ([f"    when: {self.when}"] if self.verdict == EXPOSED else [])


def _mtp_pcp(s: VllmSetup) -> bool:
    return s.pcp > 1 and s.method == "mtp" and s.k >= 1


def _piecewise(s: VllmSetup) -> str | None:
    if _mtp_pcp(s) and s.graph_mode in ("PIECEWISE", "FULL_AND_PIECEWISE"):
        return (f"PCP={s.pcp}, MTP K={s.k}, {s.graph_mode}: the draft prefill replays a PIECEWISE graph captured "
                "on the speculator's own input buffers while get_draft_input_buffers hands the model the rank-local "
                "batch's")
    return None


def _full_state(s: VllmSetup) -> str | None:
    if _mtp_pcp(s) and s.k >= 2 and s.graph_mode in ("FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"):
        return (f"PCP={s.pcp}, MTP K={s.k}, {s.graph_mode}: a FULL draft-prefill replay runs no Python, so "
                "restore_draft_prefill never clears draft_prefill_batch")
    return None


def _dspark(s: VllmSetup) -> str | None:
    if s.pcp > 1 and s.method == "dspark" and s.k >= 1:
        return (f"PCP={s.pcp}, DSpark: PCPManager.get_dummy_block_tables zeroes only its own tables, so a dummy "
                "run's query slots come from the last real step's input_block_tables")
    return None


FINDINGS: tuple[Finding, ...] = (
    Finding("piecewise_draft_prefill", "piecewise-draft-prefill.md", _piecewise,
            "every step that draft-prefills through a PIECEWISE graph (under FULL_AND_PIECEWISE: every step "
            "with a prefill); acceptance collapses, tokens stay the same"),
    Finding("full_draft_prefill_state", "full-draft-prefill-state.md", _full_state,
            "a decode-only step whose draft prefill replays a FULL graph while its draft decodes find none "
            "(a batch size with a FULL prefill graph but no FULL decode graph); with sharded decodes and one "
            "decode, the ranks' collectives diverge (a hang)"),
    Finding("dspark_dummy_run_block_tables", "dspark-dummy-run-stale-block-tables.md", _dspark,
            "a dummy run with attention after real steps (an idle data-parallel rank, a warm-up); live draft "
            "K/V is overwritten"),
)
"""pcpviz's findings in vLLM 0.33.0 under PCP, in ``docs/findings/`` order of discovery."""


def parse_fixes(text: str | None) -> tuple[str, ...]:
    """A ``PCPVIZ_FIXES`` value as finding names in ``FINDINGS`` order (``all``: every one).
    ValueError (one line) names an unknown one.

        >>> parse_fixes("full_draft_prefill_state, piecewise_draft_prefill")
        ('piecewise_draft_prefill', 'full_draft_prefill_state')
    """
    names = {n.strip() for n in (text or "").split(",") if n.strip()}
    known = [f.name for f in FINDINGS]
    unknown = sorted(names - set(known) - {"all"})
    if unknown:
        raise ValueError(f"unknown fix {unknown[0]!r}; known: {', '.join(known)} (or all)")
    return tuple(n for n in known if n in names or "all" in names)


def exposures(s: VllmSetup) -> list[Exposure]:
    """One ``Exposure`` per finding: exposed (with why and when), not exposed, fixed (its opt-in fix
    is on), or every one REFUSED when vLLM 0.33.0 refuses the configuration."""
    refused = vllm_refuses(s)
    out = []
    for f in FINDINGS:
        if refused is not None:
            out.append(Exposure(f.name, f.doc, REFUSED, refused, f.when))
            continue
        why = f.needs(s)
        if why is None:
            out.append(Exposure(f.name, f.doc, NOT_EXPOSED, _not_why(f.name, s), f.when))
        elif f.name in s.fixes:
            out.append(Exposure(f.name, f.doc, FIXED, f"{why}; its fix is on (PCPVIZ_FIXES={f.name})", f.when))
        else:
            out.append(Exposure(f.name, f.doc, EXPOSED, why, f.when))
    return out


def _not_why(name: str, s: VllmSetup) -> str:
    if s.pcp <= 1:
        return "PCP is off"
    if name == "dspark_dummy_run_block_tables":
        return f"the drafter is {s.method or 'none'}, not DSpark"
    if s.method != "mtp" or s.k < 1:
        return f"the drafter is {s.method or 'none'}, not MTP"
    if name == "full_draft_prefill_state" and s.k < 2:
        return "K=1 has no draft decodes"
    return f"{s.graph_mode} draft-prefills through no {'PIECEWISE' if name.startswith('piece') else 'FULL'} graph"
