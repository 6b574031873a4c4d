"""Train the shipped tiny DeepSeek-V3-architecture model (main LM + one MTP module).

Launch manual
=============

CPU only (4-5 s per step on 2 shared cores, so about 20 minutes; a weaker model than the
shipped one — this exact run was not carried to the end here)::

    python -m tools.train.train --out data/models/pcpviz-tiny-dsv3 --device cpu \\
        --steps 250 --batch 8 --seq-len 256 --seed 0

How the shipped weights were made (``training.json`` in the model directory records the run:
arguments, a ``reproduce`` command with the step count fixed, losses, corpus hash): one H200,
255 s of training, 12581 steps of 12 x 2048 tokens with bf16 autocast, on a frozen copy of this
machine's Python 3.11 stdlib::

    python -m tools.train.corpus --pack stdlib.tar.gz
    python -m tools.train.train --out data/models/pcpviz-tiny-dsv3 --device cuda \\
        --corpus-pack stdlib.tar.gz --batch 12 --seq-len 2048 --steps 12581 --seed 0

(it was launched with ``--time-budget-s 270`` instead of ``--steps``: the script timed 10 steps
and picked 12581.) Trained on 2048-token windows, the model is good up to ~2k positions and
degrades past them (held-out loss ~4.6 at positions 2k-4k, ~6.3 at 4k-8k): longer prompts are
legal (``max_position_embeddings`` 32768) but not meaningful text for it.

Long context: ``--pos-skip-prob P --pos-skip-max 32768`` trains a fraction P of the windows with
a PoSE-style position skip (contiguous text, positions jumping once), so relative distances up
to 32k are seen. ``data/models/pcpviz-tiny-dsv3-long`` was made so, in two stages from the shipped
weights on one H200 (its ``training.json`` chains all three runs under ``previous_stages``)::

    # stage 1: 2,048-token windows, 330 s (20,412 steps)
    python -m tools.train.train --out OUT1 --init-from data/models/pcpviz-tiny-dsv3 \
        --device cuda --corpus-pack stdlib.tar.gz --batch 12 --seq-len 2048 --lr 5e-4 \
        --warmup 0.05 --pos-skip-prob 0.5 --pos-skip-max 32768 --time-budget-s 330 --seed 0
    # stage 2: 8,192-token windows, 200 s (8,392 steps)
    python -m tools.train.train --out data/models/pcpviz-tiny-dsv3-long --init-from OUT1 \
        --device cuda --corpus-pack stdlib.tar.gz --batch 3 --seq-len 8192 --lr 3e-4 \
        --warmup 0.05 --pos-skip-prob 0.5 --pos-skip-max 32768 --time-budget-s 200 --seed 1 \
        --long-eval-tokens 32768 --long-eval-seqs 8

Held-out main loss by position over 8 sequences of 32,768 tokens (``data/bench/long_context.json``):
8k-32k over below-2k is 4.85 for the shipped model, 1.40 after stage 1 (2k windows only) and
1.08 after stage 2; the short-context held-out loss also drops (1.346 -> 1.270). The shipped
model stays the default: the expected tokens, the shipped traces (real vLLM's included) and the
PIECEWISE finding's exact drafts are tied to its weights. Use the long model for prompts past
~2k tokens (``pcpviz.run(..., model_dir=...)``, ``benchmarks/bench_long_acceptance.py``).
``--eval-only --init-from DIR`` evaluates a model as it is (``OUT/eval.json``).

The second model, MoE + DSA (``data/models/pcpviz-tiny-moe-dsa``, ``pcpviz.engine.model_v32``),
trains with ``--config data/models/pcpviz-tiny-moe-dsa/config.json`` (the architecture flags are
then ignored); its objective adds the indexer's KL and the experts' bias update
(``tools.train.objective_v32``: ``--dsa-dense-frac``, ``--bias-update-speed``), and
``docs/moe-dsa-model.md`` holds its one-H200 command and what it measured.

``--time-budget-s S`` (instead of ``--steps``) measures the step time first and picks the largest
step count that fits in ``S`` seconds; the chosen count is written to ``training.json`` so the run
can be repeated with ``--steps``.

Data: the Python standard library's ``*.py`` sources (``tools/train/corpus.py``), split by a
keyed hash of the module path into train (~95%) and held-out (~5%) modules. Each file is one
document ``<bos> bytes <eos>``; training windows are uniform random crops of the concatenated
training stream (positions restart at 0 in every window). ``--corpus-pack FILE`` trains on a
frozen corpus written by ``python -m tools.train.corpus --pack FILE`` (byte-identical text on
another machine).

Objective (``tools.train.objective``): ``loss = CE(main, t_{p+1}) + mtp_weight * CE(mtp, t_{p+2})``
where the MTP layer at position p sees the main model's final hidden h_p and the embedding of
t_{p+1} (zeroed at position 0, as vLLM does at inference); the held-out figures are
``tools.train.heldout``'s. The MTP embedding and output head are tied to the main
model's during training (DeepSeek-V3) and saved as separate tensors in DeepSeek's layout.

Outputs in ``--out``: ``config.json``, ``model.safetensors`` (bf16 by default), ``tokenizer.json``,
``tokenizer_config.json``, ``special_tokens_map.json``, ``generation_config.json`` and
``training.json`` (arguments, seed, steps, wall time, device, final train losses, held-out main /
MTP losses, MTP-vs-main greedy agreement on held-out source, corpus split hash, environment).

Runs with only ``torch`` installed (``safetensors`` is optional here: a small built-in writer
is used without it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time

import torch

from pcpviz.engine import tokenizer as tok
from pcpviz.engine.checkpoint import load_model, save_model
from pcpviz.engine.model import TinyDSV3
from pcpviz.engine.model_config import TinyDSV3Config
from pcpviz.engine.model_v32 import TinyDSV32, build_model
from tools.train import corpus as corpus_mod
from tools.train.heldout import evaluate, evaluate_long
from tools.train.objective import window_losses
from tools.train.objective_v32 import expert_loads, indexer_recall, update_expert_bias


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.train.train", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="model directory to write")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 600)")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="pick --steps from measured step time to fit this many seconds of training")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=float, default=0.03, help="warmup fraction of steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--mtp-weight", type=float, default=0.3)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--eval-tokens", type=int, default=65536, help="held-out tokens to evaluate")
    p.add_argument("--corpus-pack", default=None, help="train on a frozen corpus pack")
    p.add_argument("--save-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--init-from", default=None,
                   help="continue from this model directory (fine-tuning stage; its training.json is kept)")
    p.add_argument("--pos-skip-prob", type=float, default=0.0,
                   help="fraction of windows trained with a position skip (PoSE-style long-context)")
    p.add_argument("--pos-skip-max", type=int, default=32768,
                   help="largest position a skipped window reaches")
    p.add_argument("--long-eval-tokens", type=int, default=8192,
                   help="held-out loss by position bucket over sequences of this many tokens")
    p.add_argument("--long-eval-seqs", type=int, default=1,
                   help="how many such held-out sequences to average")
    p.add_argument("--eval-only", action="store_true",
                   help="with --init-from: evaluate that model (no training) and write eval.json in --out")
    p.add_argument("--config", default=None,
                   help="config.json giving the architecture (e.g. data/models/pcpviz-tiny-moe-dsa/config.json: "
                        "the MoE + DSA model); the architecture flags below are then ignored")
    p.add_argument("--dsa-dense-frac", type=float, default=0.2,
                   help="DSA model: fraction of the steps in the dense warm-up stage (tools.train.objective_v32)")
    p.add_argument("--bias-update-speed", type=float, default=1e-3,
                   help="MoE model: gamma of the experts' e_score_correction_bias update after each step")
    # architecture (defaults = the shipped model)
    d = TinyDSV3Config()
    p.add_argument("--hidden-size", type=int, default=d.hidden_size)
    p.add_argument("--intermediate-size", type=int, default=d.intermediate_size)
    p.add_argument("--num-layers", type=int, default=d.num_layers)
    p.add_argument("--num-heads", type=int, default=d.num_heads)
    return p.parse_args(argv)


def _reproduce_command(args, steps: int) -> str:
    """The same run with the step count fixed (no --time-budget-s)."""
    skip = {"time_budget_s", "steps", "out"}
    parts = ["python -m tools.train.train", "--out", "OUT", "--steps", str(steps)]
    for k, v in vars(args).items():
        if k in skip or v is None or v is False:
            continue
        flag = f"--{k.replace('_', '-')}"
        parts += [flag] if v is True else [flag, str(v)]
    return " ".join(parts)


def _lr_at(step: int, total: int, args) -> float:
    warm = max(1, int(args.warmup * total))
    if step < warm:
        return args.lr * (step + 1) / warm
    frac = (step - warm) / max(1, total - warm)
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cos)


def _stream(files) -> torch.Tensor:
    buf = corpus_mod.concat_tokens(files, tok.BOS_ID, tok.EOS_ID)
    return torch.frombuffer(bytearray(buf), dtype=torch.int16).to(torch.int64)


def skip_positions(B: int, L: int, prob: float, *, max_pos: int, gen: torch.Generator) -> torch.Tensor:
    """[B, L] positions: ``0..L-1``, or (with probability ``prob``) PoSE-style: the window is cut
    at a random point and the second part is shifted by a random skip, so that relative
    distances up to ``max_pos`` occur while the text stays contiguous."""
    pos = torch.arange(L).repeat(B, 1)
    if prob <= 0 or max_pos <= L:
        return pos
    for b in range(B):
        if torch.rand((), generator=gen).item() < prob:
            cut = int(torch.randint(1, L, (), generator=gen))
            skip = int(torch.randint(1, max_pos - L + 1, (), generator=gen))
            pos[b, cut:] += skip
    return pos


def _heldout_figures(model, held_stream, args, device, autocast) -> tuple[dict, dict | None]:
    """(windowed held-out metrics, loss by position bucket or None) as the arguments ask."""
    ev = evaluate(model, held_stream, args.seq_len, max_tokens=args.eval_tokens, device=device, autocast=autocast)
    ev_long = (evaluate_long(model, held_stream, args.long_eval_tokens, device=device, autocast=autocast,
                             num_seqs=args.long_eval_seqs) if args.long_eval_tokens else None)
    return ev, ev_long


def _eval_only(model, held_stream, args, device, autocast, corpus_summary) -> dict:
    """``--eval-only``: the held-out figures of ``--init-from`` as they are, in ``OUT/eval.json``."""
    ev, ev_long = _heldout_figures(model, held_stream, args, device, autocast)
    record = {"producer": "tools.train.train --eval-only", "model": args.init_from,
              "device": str(device), "heldout": ev, "heldout_by_position": ev_long,
              "corpus": {"corpus_hash": corpus_summary["corpus_hash"]}}
    print(json.dumps(record, indent=1), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "eval.json"), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    return record


def write_generation_config(out_dir: str) -> None:
    with open(os.path.join(out_dir, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump({"bos_token_id": tok.BOS_ID, "eos_token_id": tok.EOS_ID, "pad_token_id": tok.PAD_ID,
                   "do_sample": False, "max_new_tokens": 256}, f, indent=2)
        f.write("\n")


def _autocast(device: torch.device):
    """bf16 autocast on CUDA, none on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def _build_model(args) -> tuple[TinyDSV3, TinyDSV3Config, dict | None]:
    """A fresh model (``args.seed``) or the one at ``--init-from`` (and its training.json)."""
    cfg = TinyDSV3Config(hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
                         num_layers=args.num_layers, num_heads=args.num_heads, vocab_size=tok.VOCAB_SIZE,
                         bos_token_id=tok.BOS_ID, eos_token_id=tok.EOS_ID, pad_token_id=tok.PAD_ID,
                         torch_dtype=args.save_dtype)
    if args.config:
        with open(args.config, encoding="utf-8") as f:
            cfg = dataclasses.replace(TinyDSV3Config.from_hf_dict(json.load(f)), torch_dtype=args.save_dtype)
    previous = None
    if args.init_from:
        model = load_model(args.init_from, device="cpu", dtype=torch.float32)
        cfg = dataclasses.replace(model.config, torch_dtype=args.save_dtype)
        model.config = cfg
        prev_path = os.path.join(args.init_from, "training.json")
        if os.path.exists(prev_path):
            with open(prev_path, encoding="utf-8") as f:
                previous = json.load(f)
    else:
        model = build_model(cfg)  # TinyDSV32 for a deepseek_v32 config
        model.init_weights(torch.Generator().manual_seed(args.seed))
    model.tie_mtp_to_main()
    return model, cfg, previous


def _optimizer(model: TinyDSV3, args) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


class _Trainer:
    """One optimizer step at a time over random windows of the training stream."""

    def __init__(self, model: TinyDSV3, train_stream: torch.Tensor, args, device: torch.device):
        self.model, self.stream, self.args, self.device = model, train_stream, args, device
        self.opt = _optimizer(model, args)
        self.data_gen = torch.Generator().manual_seed(args.seed + 1)
        self.window = args.seq_len + 2
        self.max_start = train_stream.numel() - self.window
        self.stats: dict = {}  # the last step's extra figures (the DSA model's indexer_kl)

    def batch(self):
        a = self.args
        starts = torch.randint(0, self.max_start, (a.batch,), generator=self.data_gen)
        w = torch.stack([self.stream[s:s + self.window] for s in starts.tolist()])
        pos = skip_positions(a.batch, a.seq_len, a.pos_skip_prob, max_pos=a.pos_skip_max, gen=self.data_gen)
        return w.to(self.device, non_blocking=True), pos

    def step(self, step: int, total: int):
        for g in self.opt.param_groups:
            g["lr"] = _lr_at(step, total, self.args)
        w, pos = self.batch()
        self.stats.clear()
        sparse = step >= int(self.args.dsa_dense_frac * total)  # the DSA model's stage (objective_v32)
        with _autocast(self.device):
            loss, main, mtp, _, _ = window_losses(self.model, w, mtp_weight=self.args.mtp_weight, positions=pos,
                                                  dsa_sparse=sparse, stats=self.stats)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.grad_clip)
        self.opt.step()
        if isinstance(self.model, TinyDSV32):
            update_expert_bias(self.model, self.args.bias_update_speed)
        return loss, main, mtp, gn

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def calibrate(self, budget_s: float) -> tuple[int, float]:
        """Steps that fit ``budget_s``, from 3 warm-up and 10 timed steps; the model, optimizer
        and data order are then reset, so the run starts from scratch."""
        state = {k: v.clone() for k, v in self.model.state_dict().items()}
        for _ in range(3):
            self.step(0, 1000)
        self.sync()
        t0 = time.time()
        for _ in range(10):
            self.step(0, 1000)
        self.sync()
        measured = (time.time() - t0) / 10
        steps = max(10, int(budget_s / measured))
        print(f"measured {measured * 1000:.1f} ms/step -> {steps} steps for {budget_s:.0f}s", flush=True)
        self.model.load_state_dict(state)
        self.model.tie_mtp_to_main()
        self.opt = _optimizer(self.model, self.args)
        self.data_gen.manual_seed(self.args.seed + 1)
        return steps, measured

    def run(self, steps: int) -> tuple[list[dict], tuple, float]:
        """Train ``steps`` steps: (logged history, EMA of the (main, mtp) losses, seconds)."""
        a, t_train = self.args, time.time()
        hist, ema = [], None
        for step in range(steps):
            _, main, mtp, gn = self.step(step, steps)
            if step % a.log_every == 0 or step == steps - 1:
                m, t, lr = main.item(), mtp.item(), _lr_at(step, steps, a)
                extra = {k: round(float(v), 4) for k, v in self.stats.items()}
                hist.append({"step": step, "main": round(m, 4), "mtp": round(t, 4), "grad_norm": round(gn.item(), 3),
                             "lr": lr, "t": round(time.time() - t_train, 1), **extra})
                print(f"step {step:6d}/{steps} main {m:.4f} mtp {t:.4f} gn {gn.item():.2f} "
                      f"lr {lr:.2e} {time.time() - t_train:.0f}s {extra or ''}", flush=True)
            cur = (main.detach(), mtp.detach())
            ema = cur if ema is None else (0.95 * ema[0] + 0.05 * cur[0], 0.95 * ema[1] + 0.05 * cur[1])
        return hist, ema, time.time() - t_train


def main(argv=None) -> dict:
    args = _parse(argv)
    t_start = time.time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(args.seed)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    corp = corpus_mod.load_corpus(pack=args.corpus_pack)
    summary = corp.summary()
    train_stream = _stream(corp.split("train"))
    held_stream = _stream(corp.split("heldout"))
    print(f"corpus {summary['corpus_hash'][:16]} train {train_stream.numel()} tokens, "
          f"held-out {held_stream.numel()} tokens", flush=True)

    model, cfg, previous = _build_model(args)
    model.to(device).train()
    n_params = sum(p.numel() for p in model.parameters())  # unique (tied counted once)
    print(f"params {n_params} (unique, MTP embed/head tied)", flush=True)

    if args.eval_only:
        if not args.init_from:
            raise SystemExit("tools.train.train: --eval-only needs --init-from MODEL_DIR")
        return _eval_only(model, held_stream, args, device, lambda: _autocast(device), summary)

    trainer = _Trainer(model, train_stream, args, device)
    steps, measured = args.steps, None
    if steps is None and args.time_budget_s:
        steps, measured = trainer.calibrate(args.time_budget_s)
    if steps is None:
        steps = 600
    hist, ema, train_time = trainer.run(steps)

    ev, ev_long = _heldout_figures(model, held_stream, args, device, lambda: _autocast(device))
    if isinstance(model, TinyDSV32):
        ev["indexer_recall"] = indexer_recall(model, held_stream, args.seq_len, windows=4, device=device,
                                              autocast=lambda: _autocast(device))
    print("held-out:", json.dumps(ev), flush=True)
    print("held-out by position:", json.dumps(ev_long), flush=True)
    record = {
        "producer": "tools.train.train",
        "command": "python -m tools.train.train " + " ".join(sys.argv[1:] if argv is None else argv),
        "reproduce": _reproduce_command(args, steps),
        "args": vars(args), "seed": args.seed, "steps": steps, "measured_step_s": measured,
        "tokens_seen": steps * args.batch * args.seq_len,
        "params_unique": n_params,
        "params_stored": sum(t.numel() for t in model.state_dict().values()),
        "config": dataclasses.asdict(cfg),
        "device": str(device) + (f" ({torch.cuda.get_device_name(0)})" if device.type == "cuda" else ""),
        "train_wall_s": round(train_time, 1),
        "total_wall_s": round(time.time() - t_start, 1),
        "final_train_loss": {"main": round(float(ema[0]), 4), "mtp": round(float(ema[1]), 4),
                             "note": "EMA(0.95) of per-step losses over the last steps"},
        "heldout": ev, "heldout_by_position": ev_long, "corpus": summary, "loss_history": hist,
        "expert_loads_last_step": expert_loads(model) if isinstance(model, TinyDSV32) else None,
        "env": {"python": platform.python_version(), "torch": torch.__version__,
                "platform": platform.platform()},
    }
    if previous is not None:
        record["previous_stages"] = previous.pop("previous_stages", []) + [previous]
    _write_model_dir(model, args, record, steps=steps)
    print(f"wrote {args.out} in {time.time() - t_start:.0f}s", flush=True)
    return record


def _write_model_dir(model: TinyDSV3, args, record: dict, *, steps: int) -> None:
    """The trained model directory: weights, tokenizer and generation config, training.json."""
    out = args.out
    os.makedirs(out, exist_ok=True)
    save_model(model, out, dtype=getattr(torch, args.save_dtype),
               metadata={"producer": "tools.train.train", "seed": args.seed, "steps": steps})
    tok.write_tokenizer_files(out)
    write_generation_config(out)
    with open(os.path.join(out, "training.json"), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
