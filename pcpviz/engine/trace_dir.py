"""The trace directory of a ``pcpviz run``: claimed, and given its run.json, before the ranks start.

    owner = start_trace(cfg)            # ValueError (one line): another writer's, not empty, ...
    cfg = dataclasses.replace(cfg, trace_owner=owner.token)
    ... the ranks write rank<r>.arrow with owner.token (RunConfig.trace_owner) ...
    owner.release()

In flight-recorder mode (``PCPVIZ_FLIGHT_RECORDER``, ``pcpviz.trace.flight``) the directory holds
the dumps, each with its own run.json (``trace_meta``), so none is written at its top.
"""

from __future__ import annotations

import os

from pcpviz.engine.run_config import RunConfig
from pcpviz.trace.meta_model import RunMeta

__all__ = ["start_trace", "trace_meta"]


def start_trace(cfg: RunConfig, command: str = "pcpviz run"):
    """Claim ``cfg.trace_dir`` for this run and write its run.json; returns the claim
    (``pcpviz.trace.owner.Claim``; release it when the ranks are done), whose token the rank
    processes carry in ``RunConfig.trace_owner``. Raises ValueError (one line) when the
    directory is another writer's, not empty (without ``overwrite``) or not writable."""
    from pcpviz.trace import claim, write_run_meta
    from pcpviz.trace.flight import FlightConfig

    owner = claim(cfg.trace_dir, overwrite=cfg.overwrite, command=command)
    if FlightConfig.from_env() is not None:  # flight recorder: the dumps carry run.json, not the directory
        return owner
    try:
        write_run_meta(cfg.trace_dir, trace_meta(cfg), exclusive=True)
    except (OSError, ValueError) as exc:
        owner.release()
        raise ValueError(f"{cfg.trace_dir}: cannot write run.json ({' '.join(str(exc).split())})") from None
    return owner


def trace_meta(cfg: RunConfig) -> RunMeta:
    """run.json for a run of ``cfg``, encoded from the type (``RunMeta.build``: each key a field,
    checked as a reader checks it): the keys and values shipped traces hold."""
    return RunMeta.build(
        producer="pcpviz-engine",
        pcp=cfg.pcp, dcp=cfg.dcp, num_speculative_tokens=cfg.num_speculative_tokens,
        block_size=cfg.block_size, shard_decode_requests=cfg.shard_decode_requests
        if cfg.shard_decode_requests is not None else cfg.pcp > 1 and cfg.dcp == 1,
        model=os.path.basename(cfg.model_dir), device=cfg.device, inject=list(cfg.inject),
        max_num_batched_tokens=cfg.max_num_batched_tokens, seed=cfg.seed,
        num_requests=len(cfg.prompt_token_ids), max_new_tokens=cfg.max_new_tokens,
        prompt_token_ids=[list(p) for p in cfg.prompt_token_ids], dtype=cfg.dtype,
        model_moe=_model_moe(cfg),  # routed experts: the MoE layers gather and reduce-scatter over PCP
        **_dcp_meta(cfg),
    )


def _model_moe(cfg: RunConfig) -> bool:
    """The run's model has routed experts (``pcpviz-tiny-moe-dsa``); the dense model has none."""
    from pcpviz.engine.model_config import read_config

    try:
        return read_config(cfg.model_dir).is_moe
    except (OSError, ValueError, KeyError):
        return False


def _dcp_meta(cfg: RunConfig) -> dict:
    """run.json's DCP keys: at dcp > 1 the DCP rank of each rank file is its PCP rank (``dcp_group``
    'pcp'), and the run is labelled: vLLM 0.33.0 allows PCP + DCP for sparse MLA only."""
    if cfg.dcp == 1:
        return {}
    return {"dcp_interleave": cfg.dcp_interleave, "dcp_group": "pcp",
            "vllm_configuration": "not a vLLM 0.33.0 configuration: vLLM 0.33.0 allows PCP + DCP for "
            "sparse-MLA models only (pcp_manager.py 195-200); this is the engine's own DCP on a dense-MLA model"}

