"""Every file pcpviz writes (issue 39 items 1 and 8): a device, FIFO or socket at the output path,
or a symbolic link to one, is refused with one line and exit 2 and left as it was; a regular file
is replaced whole; a file name that is not UTF-8 is written as named.

The refusals come before any work, so they run in this process and take milliseconds.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from pcpviz.cli import main as cli_main
from pcpviz.trace.completion import record_end
from pcpviz.trace.outputs import SpecialFileError, atomic_output, write_output
from pcpviz.trace.writer import write_run_meta
from tracegen import clean_run, write

ROOT = Path(__file__).resolve().parents[2]


def run_cli(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli_main([os.fsdecode(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


def _special(tmp_path: Path, kind: str) -> Path:
    """An output path that is not a regular file: a FIFO, a socket, a link to /dev/null (a
    character device every Linux has) or a link to a FIFO."""
    p = tmp_path / f"out-{kind}.json"
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(p))
        s.close()
    elif kind == "devlink":
        os.symlink("/dev/null", p)
    elif kind == "fifolink":
        os.mkfifo(tmp_path / "fifo")
        os.symlink(tmp_path / "fifo", p)
    return p


def _unchanged(p: Path, before: os.stat_result) -> None:
    after = os.lstat(p)
    assert (after.st_mode, after.st_ino) == (before.st_mode, before.st_ino)
    assert not [n for n in os.listdir(p.parent) if n.endswith(".tmp")]


KINDS = ["fifo", "socket", "devlink", "fifolink"]


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    return write(clean_run(2, 2), tmp_path_factory.mktemp("t"))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("argv", [
    ["export", "{trace}", "--html", "{out}"],
    ["export", "{trace}", "--chrome", "{out}"],
    ["run", "--prompt", "x", "--json", "{out}"],
    ["run", "--prompt", "x", "--write-config", "{out}"],
], ids=["export-html", "export-chrome", "run-json", "run-write-config"])
def test_cli_refuses_a_special_output_file(tmp_path, trace, kind, argv):
    out = _special(tmp_path, kind)
    before = os.lstat(out)
    rc, stdout, err = run_cli([a.format(trace=trace, out=out) for a in argv])
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1 and str(out) in err and "replaced nothing" in err
    _unchanged(out, before)


@pytest.mark.parametrize("kind", KINDS)
def test_helper_refuses_and_writes_nothing(tmp_path, kind):
    out = _special(tmp_path, kind)
    before = os.lstat(out)
    with pytest.raises(SpecialFileError, match="replaced nothing"):
        write_output(out, "x")
    _unchanged(out, before)


def test_helper_refuses_a_fifo_swapped_in_while_writing(tmp_path):
    out = tmp_path / "report.html"
    with pytest.raises(SpecialFileError):
        with atomic_output(out) as fh:
            fh.write("doc")
            os.mkfifo(out)
    assert stat.S_ISFIFO(os.lstat(out).st_mode)
    assert os.listdir(tmp_path) == ["report.html"]


def test_helper_writes_through_a_link_to_a_regular_file(tmp_path):
    real = tmp_path / "real.json"
    real.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    write_output(link, "new")
    assert link.is_symlink() and real.read_text() == "new"
    write_output(tmp_path / "fresh.json", b"\x00\x01")
    assert (tmp_path / "fresh.json").read_bytes() == b"\x00\x01"


@pytest.mark.parametrize("name", ["run.json", "complete.json"])
def test_trace_directory_files_refuse_a_fifo(tmp_path, name):
    """The writer's own files: run.json and complete.json are never replaced when a FIFO sits
    there, and --overwrite removes nothing when one of the trace's files is special."""
    run_dir = tmp_path / "t"
    run_dir.mkdir()
    os.mkfifo(run_dir / name)
    with pytest.raises(ValueError, match="FIFO"):
        if name == "run.json":
            write_run_meta(run_dir, {"pcp": 1})
        else:
            record_end(run_dir, 0, status="complete", reason="", steps=0, last_step=None, nbytes=0)
    assert stat.S_ISFIFO(os.lstat(run_dir / name).st_mode)


def test_overwrite_refuses_a_special_trace_file_and_removes_nothing(tmp_path, trace):
    from pcpviz.trace import claim

    run_dir = tmp_path / "t"
    run_dir.mkdir()
    (run_dir / "rank0.arrow").write_bytes(b"x")
    os.symlink("/dev/null", run_dir / "run.json")
    with pytest.raises(ValueError, match="character device"):
        claim(run_dir, overwrite=True, command="test")
    assert (run_dir / "rank0.arrow").exists() and (run_dir / "run.json").is_symlink()


def _sub(*argv, env=None, timeout=240):
    e = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **(env or {}))
    return subprocess.run([sys.executable, "-m", "pcpviz.cli", *argv], capture_output=True, timeout=timeout, env=e)


@pytest.mark.slow
@pytest.mark.parametrize("enc", [{}, {"PYTHONIOENCODING": "utf-8"}, {"LC_ALL": "C"}], ids=["default", "strict", "C"])
def test_non_utf8_output_names_are_written(tmp_path, trace, enc):
    """``$'bad-\\xff.html'`` is a valid Linux file name: it is written, and the 'wrote' line shows
    the byte as an escape, whatever stdout's encoding."""
    html, chrome = os.fsencode(tmp_path) + b"/bad-\xff.html", os.fsencode(tmp_path) + b"/bad-\xfe.json"
    r = _sub("export", os.fsencode(trace), "--html", html, "--chrome", chrome, env=enc)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    assert os.path.getsize(html) > 1000 and json.loads(Path(os.fsdecode(chrome)).read_text())
    assert b"bad-\\xff.html" in r.stdout and b"bad-\\xfe.json" in r.stdout


def test_non_utf8_trace_directory_exports(tmp_path):
    """A trace whose directory name is not UTF-8 exports (its name in the report's title)."""
    run_dir = write(clean_run(2, 1), tmp_path, os.fsdecode(b"tr-\xff"))
    out = Path(os.fsdecode(os.fsencode(tmp_path) + b"/r\xff.json"))
    rc, stdout, err = run_cli(["export", str(run_dir), "--chrome", str(out)])
    assert rc == 0, err
    assert "\\xff" in stdout and out.stat().st_size > 100
