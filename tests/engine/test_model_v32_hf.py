"""HF parity of the MoE + DSA model: the checkpoint pcpviz writes loads into transformers'
``DeepseekV32ForCausalLM`` with no missing weight, gives the same logits, the same indexer
selections and the same greedy continuation (transformers through its own KV and indexer caches).

Where transformers 5.20.2 and vLLM 0.33.0 differ, pcpviz follows vLLM; none of these changes a
logit here beyond float rounding:

* the indexer's softmax scale: transformers scales ``q . k`` inside the relu, vLLM folds it
  into the head weights (``deepseek_v2.py:852``): equal, the scale being positive;
* ``k_norm``: transformers' ``nn.LayerNorm`` in the model dtype, vLLM's in float32
  (``deepseek_v2.py:720``); pcpviz computes it in float32;
* the top-k weights' renormalisation: transformers adds 1e-20 to the sum, vLLM does not
  (``grouped_topk_router.py:157-158``);
* fewer visible keys than ``index_topk``: transformers' top-k picks masked (future) keys too and
  the causal mask removes them again; vLLM and pcpviz mark the missing slots -1;
* vLLM scores the indexer in fp8 (q and k quantized per 128 with ue8m0 scales), transformers and
  pcpviz in bf16/float32: near-tie selections can differ on a GPU (``docs/moe-dsa-model.md``);
* transformers has no MTP block (it ignores ``model.layers.2.*``); vLLM loads it as
  ``DeepseekV32MTP``.

The weights are random (seeded; the correction biases too, so that they decide routes), written
in float32: the trained checkpoint is not in the repository yet.
"""

from __future__ import annotations

import pytest
import torch

from pcpviz.engine.checkpoint import load_model, save_model
from pcpviz.engine.model_v32 import build_model
from pcpviz.engine.model_v32_config import tiny_moe_dsa_config
from pcpviz.engine.ref_sparse import sparse_causal_attention

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("moe_dsa"))
    m = build_model(tiny_moe_dsa_config(torch_dtype="float32"))
    m.init_weights(torch.Generator().manual_seed(7))
    with torch.no_grad():
        for moe in m.moe_layers():
            moe.gate.e_score_correction_bias.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(8))
    save_model(m, d, dtype=torch.float32)
    ours = load_model(d)
    hf, info = transformers.DeepseekV32ForCausalLM.from_pretrained(
        d, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    return ours, hf.eval(), info


def test_every_weight_loads_and_only_the_mtp_block_is_left_out(pair):
    _, hf, info = pair
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert info["unexpected_keys"] and all(k.startswith("model.layers.2.") for k in info["unexpected_keys"])
    assert hf.config.index_topk == 64 and hf.config.mlp_layer_types == ["dense", "sparse"]


def test_logits_and_indexer_selections_match(pair):
    ours, hf, _ = pair
    ids = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(9))  # 150 > index_topk
    captured = {}

    def hook(module, args, out):
        captured[module.layer_idx] = out[0]

    handles = [layer.self_attn.indexer.register_forward_hook(hook) for layer in hf.model.layers]
    sel: dict = {}
    try:
        with torch.no_grad():
            a = ours(ids, attn=sparse_causal_attention(ours, record=sel))
            b = hf(ids[None]).logits[0]
    finally:
        for h in handles:
            h.remove()
    assert (a - b).abs().max() < 1e-4 * max(1.0, float(a.abs().max()))
    assert a.abs().max() > 0.1
    for layer in (0, 1):
        for t in (70, 100, 149):  # past index_topk: a real choice of 64 among t + 1
            mine = {int(r) for r in sel[layer][t] if r >= 0}
            theirs = {int(r) for r in captured[layer][t]}
            assert len(mine) == 64 and mine == theirs


@pytest.mark.slow  # ~4 s
def test_greedy_decode_matches_transformers_with_its_caches(pair):
    ours, hf, _ = pair
    prompt = torch.randint(0, 256, (60,), generator=torch.Generator().manual_seed(10))
    n_new = 12  # the context grows past index_topk = 64 while decoding
    seq = prompt.clone()
    with torch.no_grad():
        for _ in range(n_new):
            seq = torch.cat([seq, ours(seq)[-1].argmax().view(1)])
        # an explicit mask: without one, generate masks every prompt token equal to pad_token_id
        out = hf.generate(prompt[None], attention_mask=torch.ones(1, 60, dtype=torch.long), max_new_tokens=n_new,
                          do_sample=False, min_new_tokens=n_new, eos_token_id=None, pad_token_id=258)
    assert out[0, 60:].tolist() == seq[60:].tolist()


@pytest.mark.slow
def test_the_shipped_weights_match_transformers():
    """Once ``data/models/pcpviz-tiny-moe-dsa/model.safetensors`` is trained (docs/moe-dsa-model.md)."""
    import os

    from pcpviz.engine.model_v32_config import moe_model_dir

    d = moe_model_dir()
    if not os.path.exists(os.path.join(d, "model.safetensors")):
        pytest.skip("the MoE + DSA weights are not in the repository yet")
    ours = load_model(d)
    hf = transformers.DeepseekV32ForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
    ids = torch.tensor([256] + list(b"import os\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser(" * 3))
    with torch.no_grad():
        a, b = ours(ids), hf.eval()(ids[None]).logits[0]
    assert len(ids) > ours.config.index_topk
    assert (a - b).abs().max() < 1e-3 * max(1.0, float(a.abs().max()))
