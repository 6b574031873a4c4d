"""The shipped tiny DeepSeek-V3 model: transformers parity, tokenizer, MTP module, corpus split.

CPU only. Needs requirements/model.txt (transformers, tokenizers, safetensors).
"""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch

from pcpviz.engine import tokenizer as tok
from pcpviz.engine.checkpoint import load_model
from pcpviz.engine.model import causal_attention
from pcpviz.engine.model_config import TinyDSV3Config, default_model_dir, read_config
from tools.train import corpus as corpus_mod

MODEL_DIR = default_model_dir()

# Measured on the shipped weights with test_mtp_agrees_with_main_model's protocol (10 held-out
# modules, first 800 bytes each, 7980 positions): MTP greedy == main greedy at t+2 on 75.4% of
# positions, against 7.6% "chance" (product of the two models' marginal prediction frequencies).
# Known bugs drop it far below the bar: eh_proj inputs swapped -> ~4%, MTP fed t_p instead of
# t_{p+1} -> ~15%.
MIN_MTP_AGREEMENT = 0.65
MIN_AGREEMENT_OVER_CHANCE = 4.0


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return load_model(MODEL_DIR, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def corpus():
    return corpus_mod.load_corpus()


@pytest.fixture(scope="module")
def heldout_sources(corpus):
    files = [f for f in corpus.split("heldout") if len(f.data) >= 1500]
    assert len(files) >= 10
    return files


def _python_prompt(corpus, n_tokens: int = 100) -> torch.Tensor:
    src = next(f for f in corpus.split("heldout") if f.path == "colorsys.py").data
    ids = tok.encode(src)[:n_tokens]
    return torch.tensor(ids, dtype=torch.long)


# ---------------------------------------------------------------------------------------------
# checkpoint directory / config
# ---------------------------------------------------------------------------------------------


def test_directory_contents_and_size():
    names = set(os.listdir(MODEL_DIR))
    for required in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                     "generation_config.json", "training.json"):
        assert required in names, required
    total = sum(os.path.getsize(os.path.join(MODEL_DIR, n)) for n in names)
    assert total < 20 * 1024 * 1024, total


def test_config_loads_as_deepseek_v3():
    from transformers import AutoConfig, DeepseekV3Config

    hf = AutoConfig.from_pretrained(MODEL_DIR)
    assert isinstance(hf, DeepseekV3Config)
    assert hf.model_type == "deepseek_v3"
    assert hf.architectures == ["DeepseekV3ForCausalLM"]
    assert hf.kv_lora_rank == 512 and hf.qk_rope_head_dim == 64
    assert hf.qk_nope_head_dim == 128 and hf.v_head_dim == 128
    assert hf.num_nextn_predict_layers == 1
    assert hf.max_position_embeddings == 32768
    assert hf.rope_parameters["rope_type"] == "default"
    # dense everywhere, MTP block (layer index num_hidden_layers) included
    assert hf.n_routed_experts == 0
    assert hf.first_k_dense_replace >= hf.num_hidden_layers + hf.num_nextn_predict_layers
    cfg = read_config(MODEL_DIR)
    assert isinstance(cfg, TinyDSV3Config)
    assert cfg.num_layers == hf.num_hidden_layers and cfg.num_heads == hf.num_attention_heads
    assert cfg.vocab_size == hf.vocab_size == tok.VOCAB_SIZE
    assert cfg.softmax_scale == pytest.approx((128 + 64) ** -0.5)
    with pytest.raises(dataclass_error()):
        cfg.hidden_size = 1  # frozen


def dataclass_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


# ---------------------------------------------------------------------------------------------
# parity with transformers' DeepseekV3ForCausalLM
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    hf, info = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32, output_loading_info=True)
    hf.eval()
    return hf, info


def test_hf_loads_main_model_and_ignores_only_mtp(hf_model, model):
    hf, info = hf_model
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    assert not info["missing_keys"], info["missing_keys"]
    assert not info["mismatched_keys"]
    n = model.config.num_layers
    assert info["unexpected_keys"], "the MTP layer should be in the checkpoint"
    assert all(k.startswith(f"model.layers.{n}.") for k in info["unexpected_keys"]), info["unexpected_keys"]
    assert not any("mlp.experts" in name or "mlp.gate." in name for name, _ in hf.named_parameters())


def test_logits_match_transformers(hf_model, model, corpus):
    hf, _ = hf_model
    ids = _python_prompt(corpus, 100)
    assert ids.numel() == 100
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        ours = model(ids)
        pos = torch.arange(ids.numel())
        ours_masked = model.logits(model.forward_hidden(ids, pos, causal_attention(model, positions=pos)))
    assert ref.shape == ours.shape == (100, model.config.vocab_size)
    assert (ours - ref).abs().max().item() < 1e-4
    assert (ours_masked - ref).abs().max().item() < 1e-4
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    # and the model is a real language model on this Python source
    loss = torch.nn.functional.cross_entropy(ours[:-1], ids[1:]).item()
    assert loss < 2.0, loss


def test_logits_match_transformers_at_offset_positions(hf_model, model, corpus):
    hf, _ = hf_model
    ids = _python_prompt(corpus, 64)
    pos = torch.arange(ids.numel()) + 1000
    with torch.no_grad():
        ref = hf(ids[None], position_ids=pos[None]).logits[0]
        ours = model(ids, pos)
    assert (ours - ref).abs().max().item() < 1e-4


def test_packed_batch_equals_separate_sequences(model, corpus):
    a = _python_prompt(corpus, 40)
    b = torch.tensor(tok.encode("import os\nprint(os.getcwd())\n"))
    ids = torch.cat([a, b])
    pos = torch.cat([torch.arange(a.numel()), torch.arange(b.numel())])
    qsl = [0, a.numel(), a.numel() + b.numel()]
    with torch.no_grad():
        packed = model.logits(model.forward_hidden(ids, pos, causal_attention(model, qsl, positions=pos)))
        sep = torch.cat([model(a), model(b)])
    assert (packed - sep).abs().max().item() < 1e-4


@pytest.mark.slow
def test_blocked_reference_attention_matches_sdpa(model, corpus, monkeypatch):
    import pcpviz.engine.model as model_mod

    src = next(f for f in corpus.split("heldout") if len(f.data) > 5000).data
    ids = torch.tensor(tok.encode(src)[:700])
    pos = torch.arange(ids.numel())
    with torch.no_grad():
        fast = model.forward_hidden(ids, pos, causal_attention(model))  # one SDPA call
        monkeypatch.setattr(model_mod, "QUERY_BLOCK", 128)
        monkeypatch.setattr(model_mod, "SDPA_MAX_LEN", 256)
        blocked = model.forward_hidden(ids, pos, causal_attention(model))  # 6 query blocks
        by_pos = model.forward_hidden(ids, pos, causal_attention(model, positions=pos))
    assert (fast - blocked).abs().max().item() < 1e-4
    assert (fast - by_pos).abs().max().item() < 1e-4


def test_attention_callback_contract(model, corpus):
    cfg = model.config
    ids = _python_prompt(corpus, 20)
    pos = torch.arange(ids.numel())
    seen = []
    ref = causal_attention(model)

    def spy(layer_idx, q_nope, q_pe, kv_c, k_pe):
        T = ids.numel()
        assert q_nope.shape == (T, cfg.num_heads, cfg.qk_nope_head_dim)
        assert q_pe.shape == (T, cfg.num_heads, cfg.qk_rope_head_dim)
        assert kv_c.shape == (T, cfg.kv_lora_rank)
        assert k_pe.shape == (T, cfg.qk_rope_head_dim)
        seen.append(layer_idx)
        out = ref(layer_idx, q_nope, q_pe, kv_c, k_pe)
        assert out.shape == (T, cfg.num_heads, cfg.v_head_dim)
        return out

    with torch.no_grad():
        h = model.forward_hidden(ids, pos, spy)
        model.mtp_forward(ids, pos, h, attn=spy)
    assert seen == list(range(cfg.num_layers)) + [cfg.num_layers]
    w_uk, w_uv = model.mla_up_weights(0)
    assert w_uk.shape == (cfg.num_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank)
    assert w_uv.shape == (cfg.num_heads, cfg.v_head_dim, cfg.kv_lora_rank)


# ---------------------------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------------------------


def _random_texts(n: int = 40):
    rng = random.Random(1234)
    pools = [
        (0x20, 0x7E), (0x00, 0x1F), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF),
        (0x4E00, 0x4FFF), (0x3040, 0x30FF), (0x1F300, 0x1F64F), (0xAC00, 0xACFF),
    ]
    out = []
    for _ in range(n):
        chars = []
        for _ in range(rng.randint(1, 60)):
            lo, hi = rng.choice(pools)
            chars.append(chr(rng.randint(lo, hi)))
        out.append("".join(chars))
    return out


def test_autotokenizer_roundtrips_bytes():
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(MODEL_DIR)
    cfg = read_config(MODEL_DIR)
    assert len(t) == tok.VOCAB_SIZE <= cfg.vocab_size
    assert (t.bos_token_id, t.eos_token_id, t.pad_token_id) == (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id)
    texts = [
        "", " ", "def f(x):\n    return x  +  1\r\n\t# done\n",
        "héllo wörld — naïve café, Ελληνικά, русский, 日本語テキスト, 한국어 🚀🐍✨",
        "\x00\x01\x7f\u00a0\u00ad\ufeff trailing   spaces  ", " it 's  ok .", "a\u0301 (combining)",
    ] + _random_texts()
    for s in texts:
        ids = t(s)["input_ids"]
        assert ids == [tok.BOS_ID] + list(s.encode("utf-8")), s
        assert ids == tok.encode(s)
        assert t.decode(ids, skip_special_tokens=True) == s
        assert tok.decode(ids) == s
    assert t.decode([tok.BOS_ID, 104, 105, tok.EOS_ID]) == "<bos>hi<eos>"


# ---------------------------------------------------------------------------------------------
# MTP module
# ---------------------------------------------------------------------------------------------

MTP_OWN = {"embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight",
           "shared_head.norm.weight", "shared_head.head.weight"}
BLOCK = {"input_layernorm.weight", "post_attention_layernorm.weight",
         "self_attn.q_proj.weight", "self_attn.kv_a_proj_with_mqa.weight",
         "self_attn.kv_a_layernorm.weight", "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight",
         "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}


def test_mtp_checkpoint_layout():
    from safetensors import safe_open

    cfg = read_config(MODEL_DIR)
    with safe_open(os.path.join(MODEL_DIR, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    prefix = f"model.layers.{cfg.num_layers}."
    mtp_keys = {k[len(prefix):] for k in keys if k.startswith(prefix)}
    assert mtp_keys == MTP_OWN | BLOCK
    for i in range(cfg.num_layers):
        assert {k[len(f"model.layers.{i}."):] for k in keys if k.startswith(f"model.layers.{i}.")} == BLOCK
    assert not any(k.startswith(f"model.layers.{cfg.num_layers + 1}.") for k in keys)


def test_mtp_load_is_strict(tmp_path):
    from safetensors.torch import load_file, save_file

    d = tmp_path / "m"
    shutil.copytree(MODEL_DIR, d)
    cfg = read_config(MODEL_DIR)
    state = load_file(str(d / "model.safetensors"))
    state.pop(f"model.layers.{cfg.num_layers}.enorm.weight")
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="enorm"):
        load_model(str(d))


def test_mtp_block_matches_transformers_decoder_layer(hf_model, model, corpus):
    """The MTP layer's decoder block == transformers' DeepseekV3DecoderLayer on the same weights."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    hf, _ = hf_model
    n = model.config.num_layers
    layer = DeepseekV3DecoderLayer(hf.config, layer_idx=0).eval()
    prefix = f"model.layers.{n}."
    block_state = {k[len(prefix):]: v for k, v in model.state_dict().items()
                   if k.startswith(prefix) and k[len(prefix):] in BLOCK}
    layer.load_state_dict(block_state, strict=True)
    ids = _python_prompt(corpus, 60)
    T = ids.numel() - 1
    pos = torch.arange(T)
    attn = causal_attention(model)
    with torch.no_grad():
        h = model.forward_hidden(ids[:T], pos, attn)
        ours = model.mtp_forward(ids[1:], pos, h, attn=attn)
        mtp = model.mtp_layer()
        e = mtp.embed_tokens(ids[1:])
        e[0] = 0.0  # position 0
        x = mtp.eh_proj(torch.cat([mtp.enorm(e), mtp.hnorm(h)], -1))[None]
        cos_sin = hf.model.rotary_emb(x, pos[None])
        ref = layer(x, attention_mask=None, position_embeddings=cos_sin, position_ids=pos[None])
        ref = ref[0] if isinstance(ref, tuple) else ref
    assert (ours - ref[0]).abs().max().item() < 1e-4


def test_mtp_is_causal(model, heldout_sources):
    ids = torch.tensor(tok.encode(heldout_sources[0].data[:400]))
    T = ids.numel() - 1
    pos = torch.arange(T)
    attn = causal_attention(model)
    p = 200
    with torch.no_grad():
        full = model.mtp_logits(model.mtp_forward(ids[1:T + 1], pos, model.forward_hidden(ids[:T], pos, attn),
                                                  attn=attn))
        cut = model.mtp_logits(model.mtp_forward(ids[1:p + 2], pos[:p + 1],
                                                 model.forward_hidden(ids[:p + 1], pos[:p + 1], attn), attn=attn))
    assert (full[:p + 1] - cut).abs().max().item() < 1e-3


@pytest.mark.slow
def test_mtp_agrees_with_main_model(model, heldout_sources):
    """Teacher-forced on held-out stdlib source: the MTP layer sees h_p and t_{p+1} and predicts
    t_{p+2}; compare its greedy choice with the main model's greedy choice at p+1."""
    agree = total = 0
    chance = 0.0
    attn = causal_attention(model)
    for f in heldout_sources[:10]:
        ids = torch.tensor(tok.encode(f.data[:800]))
        T = ids.numel() - 2
        pos = torch.arange(T)
        with torch.no_grad():
            h = model.forward_hidden(ids[:T], pos, attn)
            main = model.logits(h).argmax(-1)  # predicts t_{p+1}
            draft = model.mtp_logits(model.mtp_forward(ids[1:T + 1], pos, h, attn=attn)).argmax(-1)  # t_{p+2}
        a, b = draft[:-1], main[1:]
        agree += (a == b).sum().item()
        total += a.numel()
        fa = torch.bincount(a, minlength=tok.VOCAB_SIZE).double()
        fb = torch.bincount(b, minlength=tok.VOCAB_SIZE).double()
        chance += (fa * fb).sum().item() / a.numel()
    rate, chance_rate = agree / total, chance / total
    print(f"MTP/main greedy agreement {rate:.3f} (chance {chance_rate:.3f}) over {total} positions")
    assert rate >= MIN_MTP_AGREEMENT
    assert rate >= MIN_AGREEMENT_OVER_CHANCE * chance_rate


def test_training_record():
    with open(os.path.join(MODEL_DIR, "training.json"), encoding="utf-8") as f:
        rec = json.load(f)
    for k in ("seed", "steps", "final_train_loss", "heldout", "corpus", "command"):
        assert k in rec, k
    assert rec["heldout"]["main_loss"] < 2.0
    assert rec["corpus"]["split_key"] == corpus_mod.SPLIT_KEY


# ---------------------------------------------------------------------------------------------
# corpus split
# ---------------------------------------------------------------------------------------------


def test_corpus_split_deterministic_and_disjoint(corpus):
    paths = corpus_mod.list_sources()
    assert paths == sorted(paths) == corpus_mod.list_sources()
    assert [f.path for f in corpus.files] == paths
    train = {f.path for f in corpus.split("train")}
    held = {f.path for f in corpus.split("heldout")}
    assert train and held
    assert not (train & held)
    assert train | held == set(paths)
    assert 0.02 < len(held) / len(paths) < 0.10
    # fixed by SPLIT_KEY, independent of the machine and of the listing
    assert corpus_mod.split_of("colorsys.py") == "heldout"
    assert corpus_mod.split_of("enum.py") == "heldout"
    assert corpus_mod.split_of("os.py") == "train"
    assert corpus_mod.split_of("json/scanner.py") == "heldout"
    assert corpus_mod.split_of("json\\scanner.py".replace("\\", os.sep)) == corpus_mod.split_of("json/scanner.py")
    assert all(corpus_mod.split_of(p) == corpus_mod.split_of(p) for p in paths[:50])
    assert corpus_mod.corpus_hash(corpus.files) == corpus_mod.corpus_hash(reversed(corpus.files))
    assert not any("site-packages" in p for p in paths)


def test_corpus_pack_roundtrip(tmp_path, corpus):
    small = corpus_mod.Corpus(tuple(corpus.files[:30]), origin="test")
    path = str(tmp_path / "c.tar.gz")
    corpus_mod.write_pack(path, small)
    back = corpus_mod.read_pack(path)
    assert [(f.path, f.data) for f in back.files] == [(f.path, f.data) for f in small.files]
    assert back.hash == small.hash


def test_compiled_regions_give_the_eager_outputs():
    """``compile_regions`` cuts each forward at its attention calls; traced by dynamo (the
    ``aot_eager`` backend: no C++ compiler needed) the regions give the eager outputs exactly,
    and only inside ``regions(True)``."""
    from pcpviz.engine.checkpoint import load_model

    model = load_model(dtype=torch.float32)
    ids, pos = torch.arange(5, 17), torch.arange(12)
    attn = causal_attention(model)
    h = model.forward_hidden(ids, pos, attn)
    mtp = model.mtp_forward(ids, pos, h, attn=attn)
    model.compile_regions(backend="aot_eager")
    model.forward_hidden(ids, pos, attn)
    assert model.compiled_regions == ()  # outside regions(True) nothing is compiled
    with model.regions(True):
        h2 = model.forward_hidden(ids, pos, attn)
        mtp2 = model.mtp_forward(ids, pos, h2, attn=attn)
        logits2, rec2 = model.mtp_logits(mtp2), model.mtp_recycle_hidden(mtp2)
    assert {"rope", "norm", "attn_inputs0", "attn_outputs1", "mtp_inputs0", "mtp_logits0", "mtp_norm0"} <= set(
        model.compiled_regions)
    torch.testing.assert_close(h2, h, rtol=0, atol=0)
    torch.testing.assert_close(mtp2, mtp, rtol=0, atol=0)
    torch.testing.assert_close(logits2, model.mtp_logits(mtp), rtol=0, atol=0)
    torch.testing.assert_close(rec2, model.mtp_recycle_hidden(mtp), rtol=0, atol=0)
