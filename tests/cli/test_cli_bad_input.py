"""Every subcommand's bad inputs, as a table: each is exit 2 with one line naming the thing.

The table runs ``pcpviz.cli.main`` in this process (fast); rows marked ``sub`` also run
``python -m pcpviz.cli`` in a subprocess (what a user types). Then the trace-directory
ownership rules end to end: two runs started together into one directory (one wins, the
other gets one line and exit 2), a non-empty directory refused without --overwrite, and
--overwrite removing only the trace's own files.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import pcpviz.trace as pt
from pcpviz.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]
CPU_TRACE = ROOT / "data" / "traces" / "cpu-pcp2-mtp2"


def run_cli(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli_main(argv)
    return rc, out.getvalue(), err.getvalue()


def sub(*argv, timeout=300, cwd=None):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "kernels"),
                                                        os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "pcpviz.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


@pytest.fixture()
def files(tmp_path):
    """Paths the table's rows refer to."""
    f = {"tmp": tmp_path, "file": tmp_path / "a_file", "dir": tmp_path / "a_dir", "trace": tmp_path / "trace",
         "nested": tmp_path / "nested.json", "notjson": tmp_path / "notjson.json", "dict": tmp_path / "dict.json"}
    f["file"].write_text("x")
    f["dir"].mkdir()
    shutil.copytree(CPU_TRACE, f["trace"])
    f["nested"].write_text("[" * 100_000 + "]" * 100_000)
    f["notjson"].write_text("{nope")
    f["dict"].write_text('{"a": 1}')
    return f


# (argv with {placeholders}, text the one line must contain, also in a subprocess?)
TABLE = [
    # layout
    (["layout", "--pcp", "1000000000", "--batch", "p10"], "--pcp: expected an integer in 1..1024", True),
    (["layout", "--pcp", "2", "--batch", "p1000000000"], "at most 4096 rows and 65536 tokens", False),
    (["layout", "--pcp", "2", "--batch", "p10", "--pad", "1000000000000"], "--pad: expected an integer", False),
    (["layout", "--pcp", "2", "--batch", "p10", "--dcp", "0"], "--dcp: expected an integer", False),
    (["layout", "--pcp", "2", "--batch", "p13,d1", "--pad", "1"], "pcpviz layout: --pad 1: PCP padded token count "
     "is smaller than the largest rank-local batch: 1 < 8", False),
    (["layout", "--pcp", "2", "--batch", "p13," + "d1," * 3000 + "x"], "--batch 'p13,d1,d1,d1,d1,d1,d1,d1,d1,d1,"
     "d1,d1,d1,... (9005 characters)': batch row 3001 'x'", False),
    (["layout", "--pcp", "2", "--batch", "q10"], "not understood", False),
    (["layout", "--pcp", "x", "--batch", "p10"], "--pcp: expected an integer", False),
    # run (all refused before any rank starts)
    (["run", "--prompt", "x", "--trace", "{file}"], "exists and is not a directory", True),
    (["run", "--prompt", "x", "--trace", "{file}/sub"], "is a file, not a directory", False),
    (["run", "--prompt", "x", "--trace", "{trace}"], "already holds a trace", False),
    (["run", "--prompt", "x", "--trace", "{tmp}"], "not empty", False),
    (["run", "--prompt", "x", "--json", "{dir}"], "--json {dir}: is a directory", False),
    (["run", "--prompt", "x", "--json", "{tmp}/missing/out.json"], "does not exist", False),
    (["run", "--prompt", "x", "--write-config", "{dir}"], "--write-config {dir}: is a directory", False),
    (["run", "--prompts-file", "{nested}"], "--prompts-file {nested}: nested too deeply", True),
    (["run", "--prompts-file", "{notjson}"], "--prompts-file {notjson}", False),
    (["run", "--prompts-file", "{dict}"], "expected a JSON list of strings", False),
    (["run", "--prompts-file", "{dir}"], "not a regular file", False),
    (["run", "--prompts-file", "/dev/zero"], "not a regular file", False),
    (["run", "--prompt", "x", "--timeout", "-1"], "--timeout: expected seconds", False),
    (["run", "--prompt", "x", "--timeout", "nan"], "--timeout: expected seconds", False),
    (["run", "--prompt", "x", "--pcp", "1000"], "pcp=1000 on CPU would start 1000 processes", False),
    (["run", "--prompt", "x", "--block-size", "1000000000"], "--block-size: expected an integer", False),
    (["run", "--prompt", "x", "--mtp", "-1"], "--mtp: expected an integer in 0..64", False),
    (["run", "--prompt", "x", "--inject", "bogus"], "unknown fault 'bogus'", False),
    (["run", "--prompt", "x", "--model", "{dir}"], "has no config.json", False),
    (["run", "--prompt", "x", "--model", "{file}"], "model directory {file} is not a directory", False),
    (["run", "--prompt", "x", "--model", "{tmp}/nowhere"], "model directory {tmp}/nowhere does not exist", False),
    # check / diff / export
    (["check", "{tmp}/nowhere"], "no such run directory", True),
    (["check", "{file}"], "not a run directory", False),
    (["check", "{dir}"], "no run.json", False),
    (["diff", "{trace}", "{dir}"], "no run.json", False),
    (["export", "{trace}"], "nothing to export", False),
    (["export", "{trace}", "--html", "{dir}"], "--html {dir}", False),
    (["export", "{trace}", "--chrome", "{file}/x.json"], "--chrome {file}/x.json", False),
    # replay (answered before vLLM is imported)
    (["replay", "--trace", "{trace}"], "already holds a trace", True),
    (["replay", "--trace", "{file}"], "exists and is not a directory", False),
    (["replay", "--trace", "{tmp}/r", "--block-size", "1000000000"], "--block-size: expected an integer", False),
    (["replay", "--trace", "{tmp}/r", "--pcp", "0"], "expected a positive integer", False),
    (["replay", "--trace", "{tmp}/r", "--model", "{dir}"], "has no config.json", False),
    (["replay", "--trace", "{tmp}/r", "--model", "{tmp}/nowhere"], "model directory {tmp}/nowhere does not exist",
     False),
    (["replay", "--trace", "{tmp}/r", "--models", "scripted", "--model", "{dir}"], "the scripted models have none",
     False),
    (["nosuchcommand"], "invalid choice", False),
    # an empty path is refused, not taken as "not given" (--json "") or as "." (--trace "")
    (["run", "--prompt", "x", "--json", ""], "argument --json: expected a path, got ''", True),
    (["run", "--prompt", "x", "--write-config", " "], "argument --write-config: expected a path", False),
    (["run", "--prompt", "x", "--trace", ""], "argument --trace: expected a path", False),
    (["run", "--prompt", "x", "--prompts-file", ""], "argument --prompts-file: expected a path", False),
    (["run", "--prompt", "x", "--model", ""], "argument --model: expected a path", False),
    (["export", "{trace}", "--chrome", "{tmp}/c.json", "--html", ""], "argument --html: expected a path", False),
    (["check", ""], "argument trace: expected a path", False),
    (["diff", "{trace}", ""], "argument b: expected a path", False),
    (["explain", "{trace}", "", "--no-rerun"], "argument good: expected a path", False),
    (["replay", "--trace", ""], "argument --trace: expected a path", False),
]


@pytest.mark.parametrize("argv, needle, in_subprocess", TABLE, ids=[" ".join(r[0])[:60] for r in TABLE])
def test_bad_input_is_one_line_exit_2(files, argv, needle, in_subprocess):
    argv = [a.format(**files) for a in argv]
    needle = needle.format(**files)
    rc, out, err = run_cli(argv)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and needle in lines[0], (rc, err)
    assert lines[0].startswith(f"pcpviz {argv[0]}" if argv[0] != "nosuchcommand" else "pcpviz")
    if in_subprocess:
        r = sub(*argv)
        assert r.returncode == 2 and r.stderr.strip().splitlines() == lines and "Traceback" not in r.stderr


def test_unwritable_trace_dir_is_one_line():
    # /proc refuses new directories even to root (a read-only directory would not stop root)
    rc, _, err = run_cli(["run", "--prompt", "x", "--max-new-tokens", "1", "--trace", "/proc/pcpviz-no/t"])
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "cannot create the trace directory" in err


def test_layout_into_a_closed_pipe_is_quiet():
    p = subprocess.run(f"{sys.executable} -m pcpviz.cli layout --pcp 2 --batch p60000,d4 | head -1",
                       shell=True, capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=f"{ROOT}:{ROOT / 'kernels'}"))
    assert p.stdout.startswith("PCP=2") and "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr


def test_python_m_pcpviz_cli_knows_every_subcommand():
    r = sub("--help")
    assert r.returncode == 0
    for cmd in ("layout", "run", "check", "diff", "export", "replay"):
        assert cmd in r.stdout
    assert "3 incomplete trace" in r.stdout


# --------------------------------------------------------------------------- one writer per dir

@pytest.mark.slow
def test_two_concurrent_runs_into_one_directory(tmp_path):
    """Started together: one run wins, the other gets one line and exit 2, and the winner's
    trace is whole (not mixed)."""
    d = tmp_path / "shared"
    args = ["run", "--pcp", "2", "--mtp", "1", "--prompt", "def f(", "--max-new-tokens", "3",
            "--trace", str(d), "--quiet"]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{ROOT / 'kernels'}")
    # started from a directory holding a pcpviz/ folder: the ranks must still import the real one
    (tmp_path / "pcpviz").mkdir()
    (tmp_path / "pcpviz" / "__init__.py").write_text("raise SystemExit('the shadow pcpviz/ was imported')\n")
    procs = [subprocess.Popen([sys.executable, "-P", "-m", "pcpviz.cli", *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path) for _ in range(2)]
    results = [(p.wait(timeout=600), p.stdout.read(), p.stderr.read()) for p in procs]
    codes = sorted(rc for rc, _, _ in results)
    assert codes == [0, 2], results
    loser = next(err for rc, _, err in results if rc == 2)
    lines = loser.strip().splitlines()
    assert len(lines) == 1 and str(d) in lines[0]
    # the winner may not have written its pid yet: "in use by another writer (starting up)"
    assert "in use by pid" in lines[0] or "in use by another writer" in lines[0] \
        or "already holds a trace" in lines[0], lines[0]
    # the winner's trace is whole and consistent: one run.json, its rank files, no lock left
    assert sorted(p.name for p in d.iterdir()) == ["complete.json", "rank0.arrow", "rank1.arrow", "run.json"]
    t = pt.open(d)
    assert pt.validate(t).ok and t.meta["num_speculative_tokens"] == 1


def test_busy_directory_names_the_writer_and_overwrite_spares_other_files(tmp_path):
    d = tmp_path / "t"
    shutil.copytree(CPU_TRACE, d)
    (d / "notes.txt").write_text("mine")
    (d / "rank7.arrow.bak").write_text("mine too")
    with pt.claim(d, overwrite=True, command="pcpviz run") as c:
        # while held: another writer is refused, naming this one, even with --overwrite
        assert sorted(p.name for p in d.iterdir()) == [".writer.lock", "notes.txt", "rank7.arrow.bak"]
        r = sub("run", "--prompt", "x", "--trace", str(d), "--overwrite")
        assert r.returncode == 2 and f"in use by pid {os.getpid()}" in r.stderr and "pcpviz run" in r.stderr
        with pytest.raises(FileExistsError, match="in use by pid"):
            pt.TraceWriter(d, 0, owner="not-the-token-" + c.token)
        pt.TraceWriter(d, 0, owner=c.token).close()  # the claim's own writers may write
    assert not (d / ".writer.lock").exists()
    assert (d / "notes.txt").read_text() == "mine" and (d / "rank7.arrow.bak").exists()


def test_writer_checks_everything_before_touching_run_json(tmp_path):
    shutil.copytree(CPU_TRACE, tmp_path / "t")
    before = (tmp_path / "t" / "run.json").read_bytes()
    with pytest.raises(FileExistsError, match="rank0.arrow: already exists"):
        pt.TraceWriter(tmp_path / "t", 0, meta={"producer": "other", "pcp": 1, "block_size": 16})
    with pytest.raises(FileExistsError, match="run.json: already exists with other content"):
        pt.TraceWriter(tmp_path / "t", 5, meta={"producer": "other", "pcp": 1, "block_size": 16})
    assert (tmp_path / "t" / "run.json").read_bytes() == before
    assert not (tmp_path / "t" / "rank5.arrow").exists()


def test_stale_lock_of_a_killed_writer_is_taken_over(tmp_path):
    d = tmp_path / "t"
    code = ("import sys, time; import pcpviz.trace as pt; pt.claim(sys.argv[1], command='victim'); "
            "print('held', flush=True); time.sleep(600)")
    p = subprocess.Popen([sys.executable, "-c", code, str(d)], stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=f"{ROOT}:{ROOT / 'kernels'}"))
    assert p.stdout.readline().strip() == "held"
    with pytest.raises(ValueError, match=f"in use by pid {p.pid} .*victim"):
        pt.claim(d)
    p.kill()
    p.wait()
    with pt.claim(d) as c:  # the lock file is left behind, but nobody holds it any more
        assert json.loads((d / ".writer.lock").read_text())["token"] == c.token


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_planted_lock_is_refused_without_touching_its_target(tmp_path, kind, overwrite):
    """A ``.writer.lock`` that is a link (to a victim file) or a FIFO is one line, never
    followed (the victim keeps its bytes) and never blocks."""
    d = tmp_path / "run"
    d.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    lock = d / ".writer.lock"
    if kind == "symlink":
        lock.symlink_to(victim)
    else:
        os.mkfifo(lock)
    with pytest.raises(ValueError) as e:
        pt.claim(d, overwrite=overwrite, command="test")
    msg = str(e.value)
    assert "\n" not in msg and ".writer.lock" in msg
    assert ("symbolic link" if kind == "symlink" else "not a regular file") in msg
    assert victim.read_text() == "precious\n"


def test_planted_run_json_fifo_does_not_block_the_writer(tmp_path):
    """The plugin's writer reads an existing run.json: a FIFO there is an error, not a hang."""
    from pcpviz.trace.writer import TraceWriter

    d = tmp_path / "run"
    d.mkdir()
    os.mkfifo(d / "run.json")
    code = ("import sys; from pcpviz.trace.writer import TraceWriter\n"
            "try:\n    TraceWriter(sys.argv[1], rank=0, meta={'pcp': 1})\n"
            "except (OSError, ValueError) as e:\n    print('refused', type(e).__name__)\n")
    out = subprocess.run([sys.executable, "-c", code, str(d)], capture_output=True, text=True,
                         timeout=60)
    assert "refused" in out.stdout, out.stderr[-2000:]
    del TraceWriter


# --------------------------------------------------------------------------- item 9: the OS says no

LONG = "x" * 300  # one path component longer than NAME_MAX (255)


@pytest.mark.parametrize("argv", [
    ["check", "{tmp}/" + LONG], ["diff", "{trace}", "{tmp}/" + LONG],
    ["export", "{tmp}/" + LONG, "--html", "{tmp}/o.html"], ["export", "{trace}", "--html", "{tmp}/" + LONG + "/o.html"],
    ["export", "{trace}", "--chrome", "{tmp}/" + LONG + ".json"],
    ["explain", "{tmp}/" + LONG, "--no-rerun"], ["run", "--prompt", "x", "--trace", "{tmp}/" + LONG],
    ["run", "--prompt", "x", "--json", "{tmp}/" + LONG], ["replay", "--trace", "{tmp}/" + LONG],
], ids=lambda a: " ".join(a)[:40])
def test_a_name_too_long_is_one_line(files, argv):
    argv = [a.format(**files) for a in argv]
    rc, _, err = run_cli(argv)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith(f"pcpviz {argv[0]}: "), (rc, err)
    assert "too long" in lines[0] and "x" * 100 in lines[0], lines[0]


def test_stdout_on_a_full_disk_is_one_line():
    with open("/dev/full", "w") as full:
        env = dict(os.environ, PYTHONPATH=f"{ROOT}:{ROOT / 'kernels'}")
        r = subprocess.run([sys.executable, "-m", "pcpviz.cli", "check", str(CPU_TRACE)], stdout=full,
                           stderr=subprocess.PIPE, text=True, env=env, timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == ["pcpviz check: stdout: No space left on device"], r.stderr


@pytest.fixture()
def small_disk(tmp_path):
    """A 512 KiB tmpfs: a real full disk (ENOSPC). Needs root (mount); skipped otherwise."""
    d = tmp_path / "disk"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(d)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a small tmpfs: {r.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


def _fill(disk: Path, leave: int = 0) -> None:
    """Fill ``disk`` up to ``leave`` free bytes."""
    with open(disk / "filler", "wb") as f:
        try:
            while True:
                free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
                if free <= leave:
                    break
                f.write(b"\0" * min(65536, max(free - leave, 1)))
                f.flush()
        except OSError:
            pass


@pytest.mark.parametrize("fmt", ["html", "chrome"])
def test_a_full_disk_during_export_leaves_no_partial_file(small_disk, fmt):
    out = small_disk / ("r.html" if fmt == "html" else "r.json")
    out.write_text("the previous export\n")
    _fill(small_disk, leave=8 << 10)  # room to start writing, not to finish
    rc, _, err = run_cli(["export", str(CPU_TRACE), f"--{fmt}", str(out)])
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "No space left on device" in lines[0], err
    assert out.read_text() == "the previous export\n"  # not truncated, not replaced
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler", out.name]  # no temporary left


def test_a_full_disk_at_claim_is_one_line_and_leaves_no_directory(small_disk):
    _fill(small_disk)
    d = small_disk / "t"
    rc, _, err = run_cli(["run", "--prompt", "x", "--max-new-tokens", "1", "--trace", str(d)])
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "No space left on device" in lines[0] and str(d) in lines[0], err
    assert not d.exists()


def test_a_directory_name_that_is_not_utf8_is_read(tmp_path):
    d = os.fsdecode(os.fsencode(str(tmp_path)) + b"/bad\xff\xfename")
    shutil.copytree(CPU_TRACE, d)
    rc, out, err = run_cli(["check", d])
    assert rc == 0 and not err, err
    Path(d, "rank1.arrow").unlink()
    rc, _, err = run_cli(["check", d])
    assert rc == 3 and "rank1.arrow: missing" in err and "bad" in err


@pytest.mark.parametrize("spec", ["positions_from_cpu_cursor@99999999999999999999999", "positions_from_cpu_cursor@²",
                                  "positions_from_cpu_cursor@-1"])
def test_an_onset_step_no_run_reaches_is_refused(spec):
    rc, _, err = run_cli(["run", "--prompt", "x", "--inject", spec])
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "must be an integer in 0..1048576" in lines[0], err


@pytest.mark.parametrize("key, value", [("speculative_method", [1, 2]), ("speculative_method", {"a": 1}),
                                        ("model", ["x"]), ("num_speculative_tokens", "2" * 5000)])
def test_a_run_json_value_of_the_wrong_type_is_one_line(files, key, value):
    meta = json.loads((files["trace"] / "run.json").read_text())
    meta[key] = value
    (files["trace"] / "run.json").write_text(json.dumps(meta))
    for cmd in (["check"], ["export", "--chrome", str(files["tmp"] / "c.json")], ["explain", "--no-rerun"]):
        rc, _, err = run_cli([cmd[0], str(files["trace"]), *cmd[1:]])
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and key in lines[0] and "Traceback" not in err, (cmd, err)


# --------------------------------------------------------------------------- item 6: bounded cost

@pytest.mark.parametrize("edit, why", [
    (lambda m: m.update(max_new_tokens=32000), "max_new_tokens 32000"),
    (lambda m: m["prompt_token_ids"].extend([[1, 2, 3]] * 20000), "20003 prompts"),
    (lambda m: m.update(pcp=6), "pcp=6, but the trace has 2 rank files"),
    (lambda m: m["prompt_token_ids"].append([7] * 70000), "prompt tokens, more than the 65536"),
])
def test_explain_does_not_rerun_what_run_json_makes_expensive(files, monkeypatch, edit, why):
    import pcpviz

    def no_engine(*a, **k):
        raise AssertionError("the engine was started")

    monkeypatch.setattr(pcpviz, "run", no_engine)
    meta = json.loads((files["trace"] / "run.json").read_text())
    edit(meta)
    (files["trace"] / "run.json").write_text(json.dumps(meta))
    rc, out, err = run_cli(["explain", str(files["trace"]), "--json"])
    doc = json.loads(out)
    note = json.dumps(doc)
    assert why in note and "--no-rerun" in note, note[:2000]


def test_prompts_file_is_bounded(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps(["x"] * 5000))
    rc, _, err = run_cli(["run", "--prompts-file", str(f)])
    assert rc == 2 and err.strip().endswith("5000 prompts; a run takes at most 4096"), err
    from pcpviz.engine.run_config import build_config

    with pytest.raises(ValueError, match="more than 4194304 tokens"):
        build_config(["y" * 30000] * 200)


def test_a_rank_file_numbered_past_any_world_size_is_not_read(files):
    shutil.copy(files["trace"] / "rank1.arrow", files["trace"] / ("rank" + "9" * 30 + ".arrow"))
    rc, _, err = run_cli(["check", str(files["trace"])])
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "9" * 30 in lines[0] and "another run" in lines[0], err
