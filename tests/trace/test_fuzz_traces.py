"""A seeded fuzzer over the shipped traces: >= 500 corrupted copies per run.

Each case damages a copy of ``data/traces/<name>`` one way (a class below) and runs a command
on it (``check``, ``diff`` against the intact copy with the damaged run second and first,
``export --chrome``, ``explain --no-rerun``) through
``pcpviz.cli.main`` in this process; a sample also runs ``python -m pcpviz.cli`` in a
subprocess. Every case must end as one of:

* a one-line error: exit 2, one stderr line ``pcpviz <cmd>: ...`` (after the ``incomplete:``
  lines of damage found before it, if any);
* a documented incomplete-trace failure: exit 3, every stderr line ``pcpviz <cmd>: incomplete: ...``;
* a check failure or a difference: exit 1 (the damage was seen);
* exit 0 only if the data read back equals the original (run.json's known keys, every step,
  rank, phase and view), i.e. nothing was lost or changed.

Never a traceback, a hang (an alarm per case) or exit 0 on changed data. ``PCPVIZ_FUZZ_SEED``
picks another seed; ``PCPVIZ_FUZZ_CASES`` more cases. The counts per class and command are
written to ``fuzz_counts.json`` in the test's tmp dir and printed (``pytest -s``).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import pcpviz.trace as pt
from pcpviz.cli import main as cli_main
from pcpviz.trace.validate import META_SCHEMA

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted(p for p in (ROOT / "data" / "traces").iterdir() if (p / "run.json").is_file())
SEED = int(os.environ.get("PCPVIZ_FUZZ_SEED", "14"))
CASES = max(500, int(os.environ.get("PCPVIZ_FUZZ_CASES", "520")))
SUBPROCESS_EVERY = 26  # every 26th case also runs the CLI in a subprocess (20 of 520)
COMMANDS = ("check", "diff", "export", "explain", "diff-damaged-first")


# --------------------------------------------------------------------------- what "unchanged" is

def fingerprint(run_dir: Path) -> str:
    """A digest of everything a reader gets: run.json's known keys, ranks, steps, every view."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = pt.open(run_dir)
    h = hashlib.sha256()
    h.update(json.dumps({k: t.meta.get(k) for k in sorted(META_SCHEMA)}, sort_keys=True).encode())
    h.update(repr((t.ranks, [t.rank_steps(r) for r in t.ranks], sorted(t.unreadable))).encode())
    for r in t.ranks:
        for s in t.rank_steps(r):
            for ph in t.phases(s, r):
                for name, a in t.record(s, r, ph).items():
                    a = np.asarray(a)
                    h.update(f"{s}/{r}/{ph}/{name}/{a.dtype.str}/{a.shape}".encode())
                    h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


# --------------------------------------------------------------------------- the damage

def _rank_files(d: Path) -> list[Path]:
    return sorted(d.glob("rank*.arrow"))


def flip(rng: random.Random, d: Path, base: Path) -> str:
    f = rng.choice(_rank_files(d))
    b = bytearray(f.read_bytes())
    n = rng.choice((1, 1, 2, 4))
    for _ in range(n):
        i = rng.randrange(len(b))
        b[i] ^= 1 << rng.randrange(8)
    f.write_bytes(bytes(b))
    return f"{f.name}: {n} bit(s)"


def truncate(rng: random.Random, d: Path, base: Path) -> str:
    f = rng.choice(_rank_files(d))
    size = f.stat().st_size
    cut = rng.choice((rng.randrange(size), size - 8, size - rng.randrange(1, 200), rng.randrange(64)))
    os.truncate(f, max(0, cut))
    return f"{f.name} at {max(0, cut)} of {size}"


def delete(rng: random.Random, d: Path, base: Path) -> str:
    what = rng.choice(("rank", "rank", "run.json", "all ranks"))
    if what == "rank":
        f = rng.choice(_rank_files(d))
        f.unlink()
        return f.name
    if what == "run.json":
        (d / "run.json").unlink()
        return "run.json"
    for f in _rank_files(d):
        f.unlink()
    return "every rank file"


def _refutable(base: Path, other: Path) -> bool:
    a, b = (json.loads((p / "run.json").read_text()) for p in (base, other))
    keys = ("pcp", "num_speculative_tokens", "block_size")
    if any(a.get(k) != b.get(k) for k in keys):
        return True
    if "prompt_token_ids" not in b:
        return False
    mine = a.get("prompt_token_ids")
    if mine is None and isinstance(a.get("prompts"), list):  # a vLLM recording keeps the text
        from pcpviz.engine.tokenizer import encode

        mine = [encode(t) for t in a["prompts"]]
    return mine is not None and b["prompt_token_ids"] != mine


def swap(rng: random.Random, d: Path, base: Path) -> str:
    """Files exchanged or mixed in: rank files swapped, a rank file of another run, a rank
    file copied under the next rank's name, run.json of another run."""
    other = rng.choice([p for p in SHIPPED if p.name != base.name] or SHIPPED)
    how = rng.choice(("swap ranks", "foreign rank", "extra rank", "foreign run.json"))
    if how == "foreign run.json":
        # only a run.json the data can refute: another PCP size, K, block size or prompt list
        refutable = [p for p in SHIPPED if p.name != base.name and _refutable(base, p)]
        if not refutable:
            how = "swap ranks"
        else:
            other = rng.choice(refutable)
    files = _rank_files(d)
    if how == "swap ranks" and len(files) < 2:  # a PCP=1 trace: nothing to swap with
        how = "foreign rank"
    if how == "swap ranks":
        a, b = files[0], files[-1]
        tmp = d / "tmp.swap"
        a.rename(tmp)
        b.rename(a)
        tmp.rename(b)
    elif how == "foreign rank":
        f = rng.choice(files)
        src = other / f.name if (other / f.name).exists() else other / "rank0.arrow"  # a PCP=1 run has rank 0 only
        shutil.copyfile(src, f)
    elif how == "extra rank":
        shutil.copyfile(files[-1], d / f"rank{len(files)}.arrow")
    else:
        shutil.copyfile(other / "run.json", d / "run.json")
    return f"{how} ({other.name})"


def replace(rng: random.Random, d: Path, base: Path) -> str:
    """A rank file or run.json replaced by something that is not a file of the trace."""
    target = rng.choice(_rank_files(d) + [d / "run.json"])
    how = rng.choice(("directory", "/dev/zero", "dangling link", "empty", "garbage", "fifo"))
    target.unlink()
    if how == "directory":
        target.mkdir()
    elif how == "/dev/zero":
        target.symlink_to("/dev/zero")
    elif how == "dangling link":
        target.symlink_to(d / "nowhere")
    elif how == "empty":
        target.write_bytes(b"")
    elif how == "garbage":
        target.write_bytes(rng.randbytes(rng.randrange(1, 4096)))
    else:
        os.mkfifo(target)
    return f"{target.name} -> {how}"


_HUGE = "<5000 digits>"


# keys whose plausible other values the data refutes; the others (a producer's label, the
# token budget) only get values their type or range refutes
DATA_CHECKED = ("pcp", "dcp", "num_speculative_tokens", "block_size")


def _hostile_value(rng: random.Random, key: str, value):
    pick = rng.randrange(12) if key in DATA_CHECKED else rng.choice((0, 1, 2, 3, 4, 6, 7, 9, 10))
    if key == "shard_decode_requests" and pick in (1, 2, 3, 4, 6, 7, 9, 10):
        pick = rng.choice((0, 2, 6))
    if pick == 0:
        return str(value)  # the right value as a string
    if pick == 1:
        return None if key in ("producer", "pcp") else [value]
    if pick == 2:
        return 2 ** 63
    if pick == 3:
        return -1
    if pick == 4:
        return 0
    if pick == 5:
        return True
    if pick == 6:
        return 1.5
    if pick == 7:
        return {"nested": value}
    if pick == 8 and isinstance(value, int) and not isinstance(value, bool):
        return value + rng.choice((-1, 1, 2))  # plausible, but not this trace's
    if pick == 9:
        return _HUGE  # an int of 5000 digits: more than Python's int parser takes (4300)
    if pick == 10:
        return float("nan")
    return "x" * rng.randrange(0, 5)


def hostile_meta(rng: random.Random, d: Path, base: Path) -> str:
    path = d / "run.json"
    meta = json.loads(path.read_text())
    how = rng.choice(("value", "value", "value", "drop", "deep", "not json", "truncated json",
                      "top-level list", "extra keys", "schema version", "huge"))
    checked = ["producer", "pcp", "dcp", "num_speculative_tokens", "block_size",
               "shard_decode_requests", "inject", "prompt_token_ids", "max_new_tokens"]
    if how == "value":
        key = rng.choice(checked)
        new = _hostile_value(rng, key, meta.get(key))
        meta[key] = new
        path.write_text(json.dumps(meta, allow_nan=True).replace(f'"{_HUGE}"', "9" * 5000))
        return f"{key} = {str(new)[:20]}"
    if how == "drop":
        key = rng.choice(("producer", "pcp", "block_size", "num_speculative_tokens"))
        meta.pop(key, None)
        if key == "block_size":
            meta.pop("block_sizes", None)  # the plugin also writes the per-group list: drop the value, not a copy
        path.write_text(json.dumps(meta))
        return f"drop {key}"
    if how == "deep":
        depth = rng.choice((1000, 100_000))
        path.write_text(json.dumps(meta)[:-1] + ', "deep": ' + "[" * depth + "]" * depth + "}")
        return f"nested {depth}"
    if how == "not json":
        path.write_bytes(rng.randbytes(rng.randrange(1, 300)))
        return "random bytes"
    if how == "truncated json":
        text = path.read_text()
        path.write_text(text[: rng.randrange(len(text))])
        return "truncated"
    if how == "top-level list":
        path.write_text(json.dumps([meta]))
        return "list"
    if how == "extra keys":  # allowed: producers add keys of their own (RunMeta.extra); the data is unchanged
        extra = {"gpu_names": ["H200", "H200"], "rack": "r7", "launcher": "vllm serve ...",
                 f"x{rng.randrange(100)}": {"any": [1, "two"]}}
        assert not set(extra) & set(META_SCHEMA)  # keys pcpviz knows are typed: changing one is changing data
        meta.update(extra)
        path.write_text(json.dumps(meta))
        return "extra keys"
    if how == "schema version":
        meta["pcpviz_trace_schema"] = rng.choice((0, 2, 3, "one", None, -5, 99, "9" * 5000))
        path.write_text(json.dumps(meta))
        return f"schema {str(meta['pcpviz_trace_schema'])[:20]}"
    path.write_text(json.dumps(meta)[:-1] + ', "pad": "' + "x" * (70 << 20) + '"}') if rng.random() < 0.1 \
        else path.write_text(json.dumps({**meta, "dcp": 2 ** 63}))
    return "huge"


def crafted(rng: random.Random, d: Path, base: Path) -> str:
    """Valid framing, hostile content: one step (on one rank or all) re-written with sizes a
    reader would allocate from (positions, lengths, counts of 2**40, a 40-d view, a bogus
    query_start_loc, a 2 MB request id): see ``tests/helpers/hostile.py``."""
    from hostile import EDITS, rewrite

    name = rng.choice(sorted(k for k in EDITS if k != "injected strings"))  # ids are free-form: data, not damage
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        steps = pt.open(base).steps
    at, ranks = rng.choice(steps), rng.choice(("all", 0, 1))
    edit_rng = random.Random(rng.random())

    def edit(step, rank, phases):
        if step == at and ranks in ("all", rank):
            before = {(ph, k): np.array(v) for ph, views in phases.items() for k, v in views.items()}
            EDITS[name](edit_rng, step, rank, phases)
            after = {(ph, k): np.asarray(v) for ph, views in phases.items() for k, v in views.items()}
            if any(before[k].shape != after[k].shape or before[k].dtype != after[k].dtype
                   or not np.array_equal(before[k], after[k]) for k in before):
                CRAFTED_CHANGED.add(str(d))

    CRAFTED_CHANGED.discard(str(d))
    shutil.rmtree(d)
    rewrite(base, d, edit)
    return f"{name} at step {at} on rank {ranks}"


CRAFTED_CHANGED: set[str] = set()  # case directories whose crafted edit changed a view


CLASSES = {"flip": flip, "truncate": truncate, "delete": delete, "swap": swap, "replace": replace,
           "hostile run.json": hostile_meta, "crafted": crafted}
WEIGHTS = {"flip": 4, "truncate": 2, "delete": 1, "swap": 1, "replace": 1, "hostile run.json": 3, "crafted": 2}


# --------------------------------------------------------------------------- running a command

class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang()


def _argv(cmd: str, d: Path, base: Path, out: Path) -> list[str]:
    if cmd == "check":
        return ["check", str(d)]
    if cmd == "diff":
        return ["diff", str(base), str(d)]
    if cmd == "diff-damaged-first":
        return ["diff", str(d), str(base)]
    if cmd == "explain":
        return ["explain", "--no-rerun", str(d)]
    return ["export", str(d), "--chrome", str(out / "t.json")]


def run_in_process(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(60)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rc = cli_main(argv)
    except _Hang:
        rc, err = -1, io.StringIO("HANG: no answer in 60 s")
    except BaseException as exc:  # noqa: BLE001 - a traceback is what the fuzzer hunts
        import traceback

        rc, err = -2, io.StringIO("Traceback (in process)\n" + traceback.format_exc())
        del exc
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return rc, out.getvalue(), err.getvalue()


def run_subprocess(argv: list[str]) -> tuple[int, str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "kernels"),
                                                        os.environ.get("PYTHONPATH", "")]))
    try:
        p = subprocess.run([sys.executable, "-m", "pcpviz.cli", *argv], capture_output=True, text=True,
                           timeout=120, env=env)
    except subprocess.TimeoutExpired:
        return -1, "", "HANG: no answer in 120 s"
    return p.returncode, p.stdout, p.stderr


def verdict(cmd: str, rc: int, err: str, changed) -> str | None:
    """None if the outcome is allowed, else what is wrong. ``changed()`` says whether the data
    read back differs from the original (called only for exit 0)."""
    lines = [line for line in err.splitlines() if line.strip()]
    if "Traceback" in err or rc < 0:
        return f"crash/hang (rc {rc})"
    if rc == 2:  # one line; 'incomplete:' lines found before the error may precede it
        head = [line for line in lines[:-1] if not line.startswith(f"pcpviz {cmd}: incomplete: ")]
        if not lines or head or not lines[-1].startswith(f"pcpviz {cmd}: ") \
                or lines[-1].startswith(f"pcpviz {cmd}: incomplete: "):
            return f"exit 2 without one 'pcpviz {cmd}:' error line: {lines[:3]}"
        return None
    if rc == 3:
        if not lines or not all(line.startswith(f"pcpviz {cmd}: incomplete: ") for line in lines):
            return f"exit 3 without 'incomplete:' lines: {lines[:3]}"
        return None
    if rc == 1:
        return None if cmd in ("check", "diff", "explain") else "export exit 1"
    if rc == 0:
        if lines:
            return f"exit 0 with stderr: {lines[:2]}"
        return "exit 0 on changed data" if changed() else None
    return f"unexpected exit code {rc}"


# --------------------------------------------------------------------------- the test

@pytest.mark.slow
def test_fuzz_shipped_traces(tmp_path):
    rng = random.Random(SEED)
    bases = {}
    originals = {}
    for src in SHIPPED:
        bases[src.name] = tmp_path / "base" / src.name
        shutil.copytree(src, bases[src.name])
        originals[src.name] = fingerprint(bases[src.name])
    counts: dict[str, collections.Counter] = {"class": collections.Counter(), "command": collections.Counter(),
                                              "outcome": collections.Counter(),
                                              "subprocess": collections.Counter()}
    failures = []
    names = list(CLASSES)
    weights = [WEIGHTS[n] for n in names]
    for i in range(CASES):
        base_name = rng.choice(sorted(bases))
        base = bases[base_name]
        klass = rng.choices(names, weights)[0]
        cmd = COMMANDS[i % len(COMMANDS)]
        d = tmp_path / "case" / base_name
        out = tmp_path / "out"
        for p in (d.parent, out):
            shutil.rmtree(p, ignore_errors=True)
        out.mkdir(parents=True)
        shutil.copytree(base, d)
        what = CLASSES[klass](rng, d, base)
        argv = _argv(cmd, d, base, out)

        def changed() -> bool:
            if klass == "crafted" and cmd == "export":
                return False  # an export draws what a producer said; it is the checks' job to judge it
            if klass == "crafted":
                return str(d) in CRAFTED_CHANGED  # exit 0 on a changed view would miss it
            try:
                return fingerprint(d) != originals[base_name]
            except Exception:  # noqa: BLE001 - unreadable now means changed
                return True

        runs = [("in-process", run_in_process)]
        if i % SUBPROCESS_EVERY == 0:
            runs.append(("subprocess", run_subprocess))
        for how, runner in runs:
            rc, _, err = runner(argv)
            bad = verdict(argv[0], rc, err, changed)
            counts["outcome"][{0: "unchanged (exit 0)", 1: "detected (exit 1)", 2: "one-line error (exit 2)",
                               3: "incomplete (exit 3)"}.get(rc, f"exit {rc}")] += how == "in-process"
            if how == "subprocess":
                counts["subprocess"][cmd] += 1
            if bad:
                failures.append(f"case {i} [{how}] {klass} ({what}) on {base_name}, pcpviz {' '.join(argv[:1])}: "
                                f"{bad}; stderr: {err.strip()[-400:]}")
        counts["class"][klass] += 1
        counts["command"][cmd] += 1
    report = {k: dict(sorted(v.items())) for k, v in counts.items()}
    report.update(seed=SEED, cases=CASES)
    (tmp_path / "fuzz_counts.json").write_text(json.dumps(report, indent=1))
    print("\nfuzz counts:", json.dumps(report, indent=1))
    assert not failures, f"{len(failures)} of {CASES} cases misbehaved:\n" + "\n".join(failures[:20])
    assert sum(counts["class"].values()) >= 500 and set(counts["class"]) == set(CLASSES)
    assert counts["outcome"]["incomplete (exit 3)"] > 0 and counts["outcome"]["one-line error (exit 2)"] > 0


@pytest.mark.parametrize("name", [p.name for p in SHIPPED])
def test_shipped_traces_are_whole_and_valid(name):
    t = pt.open(ROOT / "data" / "traces" / name)
    assert pt.validate(t).ok, pt.validate(t).lines()
