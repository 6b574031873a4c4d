"""The launcher's torch-free model check (``pcpviz.engine.model_files``): its tensor shapes are
the model's own, for the shipped configs and variants of them, and a damaged ``model.safetensors``
is one line naming the file before any rank starts."""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from pcpviz.engine.model_config import read_config
from pcpviz.engine.model_files import check_model_dir, safetensors_shapes, tensor_shapes

ROOT = Path(__file__).resolve().parents[2]
# a model directory whose weights are still to come (pcpviz-tiny-moe-dsa before its GPU training) is left out
MODELS = [p for p in sorted((ROOT / "data" / "models").iterdir())
          if (p / "config.json").exists() and (p / "model.safetensors").exists()]


@pytest.mark.parametrize("variant", [{}, {"q_lora_rank": 96}, {"num_mtp_layers": 2, "num_layers": 3},
                                     {"num_heads": 2, "v_head_dim": 64, "kv_lora_rank": 128}])
@pytest.mark.parametrize("model_dir", MODELS, ids=lambda p: p.name)
def test_tensor_shapes_are_the_models_own(model_dir, variant):
    from pcpviz.engine.model_v32 import build_model

    cfg = dataclasses.replace(read_config(str(model_dir)), **variant)
    want = {k: tuple(v.shape) for k, v in build_model(cfg).state_dict().items()}
    assert tensor_shapes(cfg) == want


@pytest.mark.parametrize("variant", [{}, {"q_lora_rank": 96}, {"num_mtp_layers": 2, "num_layers": 3},
                                     {"first_k_dense_replace": 0, "n_shared_experts": 2, "index_n_heads": 4}])
def test_tensor_shapes_of_the_moe_dsa_model(variant):
    from pcpviz.engine.model_v32 import TinyDSV32
    from pcpviz.engine.model_v32_config import moe_model_dir, tiny_moe_dsa_config

    cfg = tiny_moe_dsa_config(**variant)
    shapes = tensor_shapes(cfg)
    assert shapes == {k: tuple(v.shape) for k, v in TinyDSV32(cfg).state_dict().items()}
    first_moe = cfg.first_k_dense_replace
    assert shapes[f"model.layers.{first_moe}.mlp.experts.7.down_proj.weight"] == (256, 128)
    assert shapes[f"model.layers.{cfg.num_layers}.mlp.gate.e_score_correction_bias"] == (8,)  # the MTP block
    if first_moe:
        assert "model.layers.0.mlp.gate_proj.weight" in shapes and "model.layers.0.mlp.gate.weight" not in shapes
    if not variant:  # the shipped directory's config is this one
        shipped = read_config(moe_model_dir())
        assert shipped == dataclasses.replace(cfg, torch_dtype=shipped.torch_dtype)


@pytest.mark.parametrize("model_dir", MODELS, ids=lambda p: p.name)
def test_the_shipped_models_pass_and_match_their_headers(model_dir):
    cfg = check_model_dir(str(model_dir))
    assert safetensors_shapes(str(model_dir / "model.safetensors")) == tensor_shapes(cfg)


def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write(path: Path, header: dict, data: bytes) -> None:
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[:-100])


def _drop_tensor(p: Path) -> None:
    h, data = _header(p)
    h.pop("model.norm.weight")
    _write(p, h, data)


def _reshape(p: Path) -> None:
    h, data = _header(p)
    h["lm_head.weight"]["shape"] = h["lm_head.weight"]["shape"][::-1]
    _write(p, h, data)


@pytest.mark.parametrize("damage, message", [
    (_truncate, "outside the"),
    (lambda p: p.write_bytes(b"\x00" * 4), "shorter than a safetensors header"),
    (lambda p: p.write_bytes(struct.pack("<Q", 1 << 40) + b"{}"), "header of"),
    (lambda p: p.write_bytes(struct.pack("<Q", 4) + b"nope"), "header is not JSON"),
    (_drop_tensor, "missing ['model.norm.weight']"),
    (_reshape, "tensor lm_head.weight has shape"),
])
def test_a_damaged_checkpoint_is_one_line_naming_the_file(tmp_path, damage, message):
    d = tmp_path / "m"
    shutil.copytree(MODELS[0], d)
    damage(d / "model.safetensors")
    with pytest.raises(ValueError) as e:
        check_model_dir(str(d))
    assert str(d / "model.safetensors") in str(e.value) and message in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_the_launchers_model_check_imports_no_torch():
    code = ("import sys; from pcpviz.engine.run_config import _prompt_ids; "
            "_prompt_ids(['def f('], None, max_new_tokens=2, num_speculative_tokens=1); "
            "print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "False"
