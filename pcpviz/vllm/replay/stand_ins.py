"""The stand-ins of the replay: what is not vLLM's own code, declared in each trace's run.json.

The target and the MTP module are deterministic functions of (token, position), no weights:
the target predicts ``next_token(t, p) = (5*t + 3*p + 7) % vocab`` for the next position, the
MTP module the same one position further. With vocab 97, a prompt ending in token 12 at
position 5 makes the target sample ``(5*12 + 3*5 + 7) % 97 = 82``. Both emulate the MLA KV write
into a per-rank cache through vLLM's real ``maybe_gather_mla_latent_cache_inputs`` (so the
slots every rank writes under PCP are vLLM's). The attention backend is a metadata builder that
only calls vLLM's ``split_decodes_and_prefills``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from vllm.forward_context import get_forward_context
from vllm.v1.attention.backends.utils import split_decodes_and_prefills
from vllm.v1.attention.ops.pcp import maybe_gather_mla_latent_cache_inputs

__all__ = ["TARGET_LAYER", "MTP_LAYER", "DSPARK_LAYER", "MODELS_DECLARATION",
           "DSPARK_MODEL_DECLARATION", "STAND_INS", "DSPARK_STATUS", "next_token", "StandInTarget", "StandInMTP",
           "StandInDSpark", "StandInMLAGroup"]

TARGET_LAYER = "model.layers.0.self_attn.attn"
MTP_LAYER = "model.layers.1.self_attn.attn"  # DeepSeek's MTP module is layer num_hidden_layers
DSPARK_LAYER = "dspark.layers.0.self_attn.attn"

MODELS_DECLARATION = (
    "stand-ins: target = deterministic function of (token, position), next token "
    "(5*token + 3*position + 7) % vocab, hidden = [token, position, ...]; MTP = the same "
    "function one position ahead (input draft id, position + 1); both emulate the MLA KV "
    "write into a per-rank [slots, 2] cache through vLLM's maybe_gather_mla_latent_cache_inputs; "
    "no weights, no real attention kernels"
)
DSPARK_MODEL_DECLARATION = (
    "DSpark drafter = stand-in: combine_hidden_states takes the restored aux state, context K/V = "
    "(token, position) at the context slots, query forward like the MTP stand-in, Markov head a small bias "
    "toward the previous token; drafter PCP=1, so its K/V is written locally on every rank"
)
STAND_INS = {
    "target_model": "deterministic (token, position) function; emulated MLA KV write via the real PCP gather helper",
    "mtp_model": "deterministic (token, position) function; emulated MLA KV write via the real PCP gather helper",
    "attention_backend": "metadata builder calling the real split_decodes_and_prefills "
                         "(treat_short_extends_as_decodes=False, as under PCP)",
    "rejection_sampler": "scripted per scenario: accepted = the scheduled drafts, bonus = target top-1; "
                         "then the real get_num_sampled_and_rejected; -1 past num_sampled",
    "scheduler": "scripted requests/chunks; async scheduling (CPU cursor ahead by the last rejection)",
    "vllm_config": "SimpleNamespace with the fields the code reads; stand-in model registry",
    "runner": "GPUModelRunner methods called unbound on a SimpleNamespace self; sampler/model-state "
              "bookkeeping are no-ops",
}
DSPARK_STATUS = (
    "DSpark (replicated drafter, scenario 'dspark'): real = DSparkSpeculator.__init__ (with a real "
    "vllm.config.ParallelConfig: vllm.config.replace raises TypeError on a namespace "
    "ParallelConfig) and DFlashSpeculator.propose on the global batch: the block-table gather into "
    "input_block_tables, the Triton prepare_dflash_inputs (query/context positions and slots, unexpanded, "
    "drafter PCP=1), _store_hidden_states on the aux hidden states restored by restore_for_sampling, "
    "_precompute_context_kv, _build_uniform_attn_metadata (draft_is_prefilling), _generate_draft -> "
    "_run_model (set_forward_context) and DSpark's sequential Markov sampling loop; prepare_dflash_inputs "
    "is also run once on the pre-gather tables to record what a drafter without the gather would write "
    "(views *_no_gather). Stand-ins: the DSpark model (combine_hidden_states, precompute_and_store_context_kv, "
    "forward, compute_draft_logits, markov_embed/markov_bias, map_draft_to_target: deterministic functions "
    "writing a per-rank draft KV cache) and set_attn's init_attn_backend (a stand-in attention group). "
    "Not run: load_dspark_model (checkpoint weights), the FULL CUDA-graph replay "
    "(query_cudagraph_manager), real attention kernels, probabilistic/top-k drafting."
)



def next_token(tokens: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    return (5 * tokens.to(torch.int64) + 3 * positions.to(torch.int64) + 7) % vocab


class _StandInModel(torch.nn.Module):
    """Shared by the stand-in target and MTP module: hidden = [token, position + shift, ...];
    logits put their maximum on ``next_token(hidden[:, 0], hidden[:, 1])``; the forward
    emulates an MLA layer's KV write (``update_kv_cache``) through vLLM's PCP gather."""

    def __init__(self, layer: str, vocab: int, hidden: int, kv_cache: torch.Tensor, shard_decodes: bool,
                 position_shift: int, use_pcp: bool = True) -> None:
        super().__init__()
        self.layer, self.vocab, self.hidden = layer, vocab, hidden
        self.kv_cache, self.shard_decodes, self.position_shift = kv_cache, shard_decodes, position_shift
        self.use_pcp = use_pcp  # the layer's own parallel config (False for a DSpark drafter: PCP=1)
        self.aux_hidden_states = False  # the target returns (hidden, [aux]) when the drafter wants it

    def _hidden(self, ids: torch.Tensor, positions: torch.Tensor, carry: torch.Tensor | None) -> torch.Tensor:
        h = torch.zeros(ids.shape[0], self.hidden, dtype=torch.float32)
        h[:, 0] = ids.to(torch.float32)
        h[:, 1] = (positions + self.position_shift).to(torch.float32)
        h[:, 2] = torch.sin(ids.to(torch.float32) * 0.1 + positions.to(torch.float32) * 0.01)
        if carry is not None:
            h[:, 3] = carry[:, 0]
        return h

    def _write_kv(self, ids: torch.Tensor, positions: torch.Tensor) -> None:
        """The MLA KV write: kv_c = [token, position] per row, slot from the forward context,
        gathered across PCP ranks exactly as MLAAttention.update_kv_cache does under PCP."""
        ctx = get_forward_context()
        md = ctx.attn_metadata.get(self.layer) if isinstance(ctx.attn_metadata, dict) else None
        slot_mapping = ctx.slot_mapping.get(self.layer) if isinstance(ctx.slot_mapping, dict) else None
        if md is None or slot_mapping is None:
            return  # profile/dummy run: attention (and the KV write) is skipped
        kv_c = torch.stack([ids.to(torch.float32), positions.to(torch.float32)], dim=1)
        k_pe = positions.to(torch.float32).reshape(-1, 1, 1)
        kv_c, _, slots = maybe_gather_mla_latent_cache_inputs(kv_c, k_pe, slot_mapping, md.num_decode_tokens,
                                                              use_pcp=self.use_pcp,
                                                              pcp_shard_decode_requests=self.shard_decodes)
        keep = slots >= 0
        self.kv_cache[slots[keep]] = kv_c[keep]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        nxt = next_token(hidden[:, 0].round(), hidden[:, 1].round(), self.vocab)
        return -(torch.arange(self.vocab).unsqueeze(0) - nxt.unsqueeze(1)).abs().to(torch.float32)


class StandInTarget(_StandInModel):
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, **_: Any) -> Any:
        self._write_kv(input_ids, positions)
        hidden = self._hidden(input_ids, positions, None)
        if self.aux_hidden_states:
            return hidden, [hidden.clone()]  # one aux layer (DSpark reads the target's aux states)
        return hidden


class StandInMTP(_StandInModel):
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor, *,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        self._write_kv(input_ids, positions)
        return self._hidden(input_ids, positions, hidden_states)


class StandInDSpark(_StandInModel):
    """The DSpark drafter's model interface as DSparkSpeculator calls it. Query forward:
    hidden = [input id, position + 1, ...] (anchor = bonus token, the others the noise token);
    draft logits peak at ``next_token``; the Markov head adds a small bias toward the
    previously sampled token. Context K/V and query K/V go into a per-rank draft cache
    (drafter PCP=1: no gather)."""

    def combine_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states[:, : self.hidden]

    def precompute_and_store_context_kv(self, hidden_states: torch.Tensor, positions: torch.Tensor,
                                        context_slots: Any = None) -> None:
        if context_slots is None:  # dummy run
            return
        slots = context_slots[0] if isinstance(context_slots, list) else context_slots
        keep = slots >= 0
        kv = torch.stack([hidden_states[:, 0], positions.to(torch.float32)], dim=1)
        self.kv_cache[slots[keep]] = kv[keep]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: Any = None) -> torch.Tensor:
        self._write_kv(input_ids, positions)
        return self._hidden(input_ids, positions, None)

    def compute_draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden)

    def markov_embed(self, prev: torch.Tensor) -> torch.Tensor:
        return prev.to(torch.float32).unsqueeze(1)

    def markov_bias(self, embed: torch.Tensor) -> torch.Tensor:
        return -1e-3 * (torch.arange(self.vocab).unsqueeze(0) - embed).abs()

    def map_draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids


class StandInMLAGroup:
    """An AttentionGroup stand-in: its builder computes what the MLA builder needs for the KV
    write, through vLLM's own ``split_decodes_and_prefills`` (which asserts the
    ``is_prefilling`` vLLM passes under PCP)."""

    supports_draft_decode_metadata_update = False
    kv_cache_spec = None

    def __init__(self, layer_names: list[str], decode_threshold: int) -> None:
        self.layer_names = layer_names
        self.decode_threshold = decode_threshold
        self.backend = SimpleNamespace(get_name=lambda: "PCPVIZ_STAND_IN_MLA")
        self._builder = SimpleNamespace(supports_update_block_table=False)

    def get_metadata_builder(self, ubatch_idx: int = 0) -> Any:
        return self._builder

    def build_metadata(self, common: Any, ubatch_idx: int = 0, **_: Any) -> Any:
        num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = split_decodes_and_prefills(
            common, decode_threshold=self.decode_threshold, treat_short_extends_as_decodes=False)
        return SimpleNamespace(num_decodes=num_decodes, num_prefills=num_prefills,
                               num_decode_tokens=num_decode_tokens, num_prefill_tokens=num_prefill_tokens,
                               num_actual_tokens=common.num_actual_tokens, slot_mapping=common.slot_mapping,
                               seq_lens=common.seq_lens, block_table=common.block_table_tensor,
                               query_start_loc=common.query_start_loc)

    def build_metadata_for_cudagraph_capture(self, common: Any, ubatch_idx: int = 0) -> Any:
        """A FULL graph's capture-time metadata: built the same way (its tensors are views of the
        persistent buffers a replay reads; its counts are fixed at capture)."""
        return self.build_metadata(common, ubatch_idx)
