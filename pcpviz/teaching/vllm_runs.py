"""vLLM 0.33.0's own functions run on small stand-in inputs, for claims the notebooks make.

* ``attention_cp_check``: ``check_attention_cp_compatibility`` on a target layer and a drafter
  layer (stand-in layers and backends: only ``supports_pcp()`` and the impl's DCP size are read),
  with the target layer names computed as ``GPUModelRunner.initialize_kv_cache`` does for every
  ``DraftModelSpeculator``, MTP included: a drafter backend without PCP support passes at any DCP;
* ``drafter_impl_pcp``: the PCP size an attention impl built for the DSpark drafter sees:
  ``AttentionImplBase.__new__`` reads it from the PCP process group, not from the drafter's
  config copy (PCP = 1), so ``pcp_world_size`` is the target's while the layer's ``use_pcp`` is
  False (``mla_attention.py`` takes ``use_pcp`` from the config);
* ``draft_prefill_graph_modes``: the CUDA-graph mode each PCP rank's draft prefill dispatches to
  (vLLM's ``SpeculatorCudaGraphManager`` built for the mode, its default capture sizes, dispatched
  with each rank's arguments from ``examples.draft_prefill_dispatch``).

Each imports vLLM on CPU (``pcpviz.vllm.cpu_patches``). PCP=2, an MTP drafter whose backend
lacks PCP support::

    attention_cp_check(draft_supports_pcp=False)          # -> None: accepted
    attention_cp_check(draft_supports_pcp=False, check_draft=True)   # -> vLLM's assertion text
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from pcpviz.reference.layout import PCPLayout

__all__ = ["attention_cp_check", "DrafterImplPCP", "drafter_impl_pcp", "draft_prefill_graph_modes"]


def _vllm() -> None:
    from pcpviz.vllm.cpu_patches import apply_cpu_patches

    apply_cpu_patches()


def attention_cp_check(*, draft_supports_pcp: bool, target_supports_pcp: bool = True, pcp: int = 2,
                       draft_dcp: int = 1, speculator: str = "mtp", check_draft: bool = False) -> str | None:
    """None when vLLM's ``check_attention_cp_compatibility`` accepts, else its assertion message.
    ``check_draft=True`` passes ``target_layer_names=None`` (every layer checked, the rule before
    the PR) instead of the names ``initialize_kv_cache`` computes for a ``DraftModelSpeculator``."""
    _vllm()
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.v1.worker.cp_utils import check_attention_cp_compatibility
    from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator
    from vllm.v1.worker.gpu.spec_decode.mtp.speculator import MTPSpeculator
    from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator

    class Layer(AttentionLayerBase):
        def __init__(self, supports: bool, dcp: int) -> None:
            self.backend = type("StandInBackend", (), {"supports_pcp": classmethod(lambda cls: supports),
                                                        "get_name": staticmethod(lambda: "STAND_IN")})
            self.impl = SimpleNamespace(dcp_world_size=dcp, supports_mtp_with_cp_non_trivial_interleave_size=True,
                                        need_to_return_lse_for_decode=True)

        def get_attn_backend(self) -> Any:
            return self.backend

        def get_kv_cache_spec(self, vllm_config: Any) -> None:
            return None

    layers = {"target": Layer(target_supports_pcp, 1), "draft": Layer(draft_supports_pcp, draft_dcp)}
    cfg = SimpleNamespace(parallel_config=SimpleNamespace(prefill_context_parallel_size=pcp,
                                                          decode_context_parallel_size=1,
                                                          cp_kv_cache_interleave_size=1),
                          speculative_config=SimpleNamespace(), compilation_config=SimpleNamespace(
                              static_forward_context=layers))
    cls = {"mtp": MTPSpeculator, "dspark": DSparkSpeculator}[speculator]
    # GPUModelRunner.initialize_kv_cache: KV-cache layer names minus the drafter's, for any
    # DraftModelSpeculator (MTP is one).
    names = None if check_draft or not issubclass(cls, DraftModelSpeculator) else set(layers) - {"draft"}
    try:
        check_attention_cp_compatibility(cfg, names)
    except AssertionError as e:
        return str(e)
    return None


@dataclass(frozen=True)
class DrafterImplPCP:
    config_pcp: int  # prefill_context_parallel_size in the drafter's config copy
    impl_pcp_world_size: int  # what AttentionImplBase.__new__ set
    impl_dcp_world_size: int


def drafter_impl_pcp(pcp: int = 2) -> DrafterImplPCP:
    """Build an attention impl on a PCP rank thread under the DSpark drafter's config (PCP = 1,
    DCP = 1, as ``DFlashSpeculator.__init__`` makes it): vLLM's ``AttentionImplBase.__new__``
    takes the DCP size from the config's flag and the PCP size from the process group."""
    _vllm()
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backend import AttentionImplBase

    from pcpviz.vllm.fake_group import FakePCPGroup, run_ranks

    class Impl(AttentionImplBase):
        pass

    cfg = SimpleNamespace(parallel_config=SimpleNamespace(prefill_context_parallel_size=1,
                                                          decode_context_parallel_size=1))

    def build(rank: int) -> DrafterImplPCP:
        with set_current_vllm_config(cfg):
            impl = Impl()
        return DrafterImplPCP(cfg.parallel_config.prefill_context_parallel_size, impl.pcp_world_size,
                              impl.dcp_world_size)

    return run_ranks(FakePCPGroup(pcp), build)[0]


def draft_prefill_graph_modes(layout: PCPLayout, mode: str, *, k: int, max_num_seqs: int = 8) -> list[str]:
    """Per rank, the graph mode (``"FULL"``, ``"PIECEWISE"``, ``"NONE"``) ``propose`` dispatches the
    draft prefill to under ``cudagraph_mode=mode``, with vLLM's default capture sizes for
    ``max_num_seqs`` and K. ``"NONE"`` mode: eager everywhere."""
    _vllm()
    from vllm.config import CUDAGraphMode

    from pcpviz.teaching.examples.pcp_paths import draft_prefill_dispatch
    from pcpviz.vllm.replay.graph_dispatch import capture_sizes, draft_prefill_manager

    cg = CUDAGraphMode[mode]
    if cg == CUDAGraphMode.NONE:
        return ["NONE"] * layout.pcp_world_size
    sizes = capture_sizes(max_num_seqs=max_num_seqs, k=k, max_num_batched_tokens=8192, mode=cg)
    mgr = draft_prefill_manager(cg, sizes=sizes, max_num_seqs=max_num_seqs, k=k)
    return [mgr.dispatch(d.num_reqs, d.num_tokens_padded, d.uniform_token_count, 0).cg_mode.name
            for d in draft_prefill_dispatch(layout)]
