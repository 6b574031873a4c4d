"""``tools/gpu/pad_indexer.py``: the shipped MoE + DSA model widened to 32 indexer heads (DeepGEMM's
minimum on Hopper) selects the same keys and gives the same logits as the model itself."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from pcpviz.engine.checkpoint import load_model
from pcpviz.engine.model_v32_config import moe_model_dir
from pcpviz.engine.ref_sparse import sparse_causal_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "gpu"))
from pad_indexer import main as pad_main  # noqa: E402
from pad_indexer import pad_indexer_heads  # noqa: E402

SRC = Path(moe_model_dir())
pytestmark = pytest.mark.skipif(not (SRC / "model.safetensors").exists(), reason="the MoE + DSA weights are absent")


def test_the_widened_model_selects_the_same_keys_and_gives_the_same_logits(tmp_path):
    dst = pad_indexer_heads(SRC, tmp_path / "h32", heads=32)
    assert json.loads((dst / "config.json").read_text())["index_n_heads"] == 32
    a, b = load_model(str(SRC)), load_model(str(dst))
    assert b.config.index_n_heads == 32 and a.config.index_n_heads == 16
    ids = torch.tensor([256] + list(b"def main(argv):\n    parser = argparse.ArgumentParser(prog)\n" * 3))
    assert len(ids) > a.config.index_topk  # the indexer really chooses
    sa, sb = {}, {}
    with torch.no_grad():
        la = a(ids, attn=sparse_causal_attention(a, record=sa))
        lb = b(ids, attn=sparse_causal_attention(b, record=sb))
    assert sa.keys() == sb.keys() and len(sa) >= 2
    for layer in sa:
        assert torch.equal(torch.sort(sa[layer], dim=-1).values, torch.sort(sb[layer], dim=-1).values), layer
    assert torch.allclose(la, lb, rtol=0, atol=1e-5) and torch.equal(la.argmax(-1), lb.argmax(-1))


def test_bad_input_is_one_line_and_nothing_is_overwritten(tmp_path, capsys):
    (tmp_path / "taken").mkdir()
    assert pad_main([str(SRC), str(tmp_path / "taken")]) == 2
    assert pad_main([str(SRC), str(tmp_path / "narrow"), "--heads", "8"]) == 2
    assert pad_main([str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("pad_indexer: ") for line in err)
    assert not os.listdir(tmp_path / "taken") and not (tmp_path / "narrow").exists()


def test_a_raised_topk_changes_nothing_while_the_context_fits_the_old_one(tmp_path):
    dst = pad_indexer_heads(SRC, tmp_path / "t128", heads=32, topk=128)
    assert json.loads((dst / "config.json").read_text())["index_topk"] == 128
    a, b = load_model(str(SRC)), load_model(str(dst))
    ids = torch.tensor([256] + list(b"import os\nimport sys\n\ndef main():\n    return 0\n"))
    assert len(ids) <= a.config.index_topk  # every key is selected with 64 as with 128
    with torch.no_grad():
        assert torch.allclose(a(ids), b(ids), rtol=0, atol=1e-5)
