"""Re-run issue 39's reliability audit, class by class, through the real ``pcpviz`` command (a
subprocess per case, as a user types it) and print one line per class and a JSON summary.

    python benchmarks/audit_reliability.py                 # the fast classes (a few minutes on 2 cores)
    python benchmarks/audit_reliability.py --slow          # + orphans, host SIGTERM, explain on shipped traces
    python benchmarks/audit_reliability.py --json out.json

A case passes when the command does what the house rules ask: bad input is one line and exit 2,
lost or damaged data one 'incomplete:' line and exit 3, nothing outside the output path is
replaced, no traceback, no process left behind. Classes:

special-output   every output option against a FIFO, a socket, a link to /dev/null and a link to a
                 FIFO: exit 2, one line, the special file untouched, no temporary left
non-utf8-names   output files named with bytes that are not UTF-8: written, exit 0
damaged-values   inf / NaN / 1e300 / 2.5 stored in an integer view: every command exits 3
bounded-products layout options whose product is huge: refused at once (exit 2)
empty-live-trace pcpviz.trace.open on a claimed directory with no step: a TraceWarning
orphans          (--slow) check/diff/export stopped by TERM/INT/KILL with PCPVIZ_WORKERS=2: no worker left
host-sigterm     (--slow) pcpviz.run inside `except Exception` + SIGTERM: the host dies of the signal
explain-shipped  (--slow) explain without GOOD on every shipped trace: exit 0
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "helpers")]
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))

from tracegen import RequestSpec, clean_run, corrupt, generate  # noqa: E402


def pcpviz(*argv, env=None, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pcpviz.cli", *map(os.fsencode, argv)], capture_output=True,
                          env={**ENV, **(env or {})}, timeout=timeout)


def one_line(r: subprocess.CompletedProcess, code: int) -> bool:
    err = r.stderr.decode(errors="replace")
    return r.returncode == code and "Traceback" not in err and len(set(err.strip().splitlines())) == 1


def special(d: Path, kind: str) -> Path:
    p = d / f"out-{kind}.json"
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(p))
        s.close()
    elif kind == "devlink":
        os.symlink("/dev/null", p)
    else:
        os.mkfifo(d / "target-fifo")
        os.symlink(d / "target-fifo", p)
    return p


def audit_special(tmp: Path, trace: Path) -> list[tuple[str, bool]]:
    out = []
    commands = [("export --html", ["export", trace, "--html"]), ("export --chrome", ["export", trace, "--chrome"]),
                ("run --json", ["run", "--prompt", "x", "--json"]),
                ("run --write-config", ["run", "--prompt", "x", "--write-config"])]
    for name, argv in commands:
        for kind in ("fifo", "socket", "devlink", "fifolink"):
            d = Path(tempfile.mkdtemp(dir=tmp))
            p = special(d, kind)
            before = os.lstat(p)
            r = pcpviz(*argv, p)
            after = os.lstat(p)
            ok = (one_line(r, 2) and (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)
                  and not [n for n in os.listdir(d) if n.endswith(".tmp")])
            out.append((f"{name} -> {kind}", ok))
    d = Path(tempfile.mkdtemp(dir=tmp))
    (d / "t").mkdir()
    os.mkfifo(d / "t" / "run.json")
    r = pcpviz("synth", "--tokens", "64", "--requests", "2", "--trace", d / "t", "--overwrite")
    out.append(("synth --overwrite over a FIFO run.json", one_line(r, 2) and (d / "t" / "run.json").is_fifo()))
    return out


def audit_non_utf8(tmp: Path, trace: Path) -> list[tuple[str, bool]]:
    out = []
    for enc in ({}, {"PYTHONIOENCODING": "utf-8"}, {"LC_ALL": "C"}):
        d = os.fsencode(tempfile.mkdtemp(dir=tmp))
        html, chrome = d + b"/bad-\xff.html", d + b"/bad-\xfe.json"
        r = pcpviz("export", trace, "--html", html, "--chrome", chrome, env=enc)
        out.append((f"export to non-UTF-8 names {enc or 'default'}",
                    r.returncode == 0 and os.path.exists(html) and os.path.exists(chrome)))
    return out


def audit_damaged(tmp: Path) -> list[tuple[str, bool]]:
    out = []
    for value in (np.inf, np.nan, 1e300, 2.5):
        run = clean_run(2, 2)
        corrupt(run, run.steps[1][0], "target", "seq_lens", lambda a: np.full(a.shape, value, dtype="<f8"), ranks=[1])
        t = run.write(Path(tempfile.mkdtemp(dir=tmp)) / "t")
        for argv in (["check", t], ["export", t, "--html", tmp / "d.html"], ["export", t, "--chrome", tmp / "d.json"],
                     ["explain", t, "--no-rerun"], ["diff", t, t]):
            out.append((f"{argv[0]} {argv[2] if argv[0] == 'export' else ''} seq_lens={value}",
                        one_line(pcpviz(*argv), 3)))
    return out


def audit_products() -> list[tuple[str, bool]]:
    out = []
    for argv in (["--pad", "65536", "--pcp", "1024", "--batch", "p13"],
                 ["--pcp", "1024", "--batch", ",".join(["d1"] * 4096)]):
        t0 = time.monotonic()
        r = pcpviz("layout", *argv, timeout=120)
        out.append((f"layout {' '.join(argv)[:40]}", one_line(r, 2) and time.monotonic() - t0 < 30))
    return out


def audit_empty_live(tmp: Path) -> list[tuple[str, bool]]:
    import pcpviz.trace as pt

    run_dir = Path(tempfile.mkdtemp(dir=tmp)) / "live"
    with pt.claim(run_dir, command="audit") as c:
        w = pt.TraceWriter(run_dir, 0, meta=clean_run(1, 1).meta, owner=c.token)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                pt.open(run_dir)
            warned = any(issubclass(x.category, pt.TraceWarning) for x in caught)
            r = pcpviz("check", run_dir)
        finally:
            w.close()
    return [("open() on a live empty trace warns", warned), ("check on it exits 3", r.returncode == 3)]


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except FileNotFoundError:
        return []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def audit_orphans(tmp: Path) -> list[tuple[str, bool]]:
    run = generate([RequestSpec(f"r{i}", 30, 700) for i in range(3)], pcp=2, num_speculative_tokens=2,
                   max_num_batched_tokens=64)
    t = run.write(tmp / "long")
    out = []
    for argv in (["check", t], ["diff", t, t], ["export", t, "--chrome", tmp / "o.json"]):
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGKILL):
            err = open(tmp / "err", "w")
            p = subprocess.Popen([sys.executable, "-m", "pcpviz.cli", *map(str, argv)], stdout=subprocess.DEVNULL,
                                 stderr=err, env={**ENV, "PCPVIZ_WORKERS": "2"})
            deadline, workers = time.monotonic() + 120, []
            while len(workers) < 2 and p.poll() is None and time.monotonic() < deadline:
                workers = _children(p.pid)
                time.sleep(0.05)
            time.sleep(0.5)
            os.kill(p.pid, sig)
            p.wait(timeout=60)
            end = time.monotonic() + 10
            while any(_alive(w) for w in workers) and time.monotonic() < end:
                time.sleep(0.1)
            left = [w for w in workers if _alive(w)]
            for w in left:
                os.kill(w, signal.SIGKILL)
            out.append((f"{argv[0]} {signal.Signals(sig).name}", len(workers) == 2 and not left))
    return out


HOST = """
import sys, pcpviz
try:
    pcpviz.run(["def fib(n):"], pcp=1, num_speculative_tokens=2, max_new_tokens=4000, trace_dir=sys.argv[1],
               progress=False)
except Exception:
    pass
print("host carried on")
"""


def audit_host_sigterm(tmp: Path) -> list[tuple[str, bool]]:
    trace = tmp / "host"
    p = subprocess.Popen([sys.executable, "-c", HOST, str(trace)], env=ENV, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while not ((trace / "rank0.arrow").exists() and (trace / "rank0.arrow").stat().st_size > 8000):
        if p.poll() is not None or time.monotonic() > deadline:
            return [("host SIGTERM", False)]
        time.sleep(0.1)
    p.send_signal(signal.SIGTERM)
    stdout, _ = p.communicate(timeout=300)
    return [("host dies of SIGTERM after the trace is finalized",
             p.returncode == -signal.SIGTERM and "carried on" not in stdout)]


def audit_explain_shipped() -> list[tuple[str, bool]]:
    out = []
    for t in sorted((REPO / "data" / "traces").iterdir()):
        if (t / "run.json").exists():
            r = pcpviz("explain", t, timeout=900)
            out.append((f"explain {t.name}", r.returncode == 0))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slow", action="store_true", help="also the classes that start engine runs or worker pools")
    ap.add_argument("--json", default=None, help="write the summary here")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="pcpviz-audit-"))
    try:
        trace = clean_run(2, 2).write(tmp / "trace")
        classes = {"special-output": lambda: audit_special(tmp, trace),
                   "non-utf8-names": lambda: audit_non_utf8(tmp, trace),
                   "damaged-values": lambda: audit_damaged(tmp),
                   "bounded-products": audit_products,
                   "empty-live-trace": lambda: audit_empty_live(tmp)}
        if a.slow:
            classes |= {"orphans": lambda: audit_orphans(tmp), "host-sigterm": lambda: audit_host_sigterm(tmp),
                        "explain-shipped": audit_explain_shipped}
        summary = {"command": " ".join([sys.executable, *sys.argv]), "classes": {}}
        for name, fn in classes.items():
            t0 = time.monotonic()
            cases = fn()
            failed = [c for c, ok in cases if not ok]
            summary["classes"][name] = {"cases": len(cases), "failed": failed,
                                        "seconds": round(time.monotonic() - t0, 1)}
            print(f"{name:18s} {len(cases) - len(failed):3d}/{len(cases)} pass"
                  + (f"  FAILED: {'; '.join(failed)}" if failed else ""), flush=True)
        total = sum(c["cases"] for c in summary["classes"].values())
        bad = sum(len(c["failed"]) for c in summary["classes"].values())
        summary["total"], summary["failed"] = total, bad
        print(f"{'total':18s} {total - bad:3d}/{total} pass")
        if a.json:
            Path(a.json).write_text(json.dumps(summary, indent=1) + "\n")
        return 1 if bad else 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
