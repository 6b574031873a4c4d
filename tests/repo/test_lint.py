"""The lint is part of the suite: ``ruff check`` with the rules of pyproject.toml's
``[tool.ruff]`` over the package, tests, benchmarks, tools and kernels."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _ruff() -> list[str]:
    exe = Path(sys.executable).with_name("ruff")
    return [str(exe)] if exe.exists() else [shutil.which("ruff") or "ruff"]


def test_ruff_finds_nothing():
    r = subprocess.run([*_ruff(), "check", "--output-format", "concise", "pcpviz", "tests", "benchmarks",
                        "tools", "kernels"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_ruff_catches_an_unused_import(tmp_path):
    """The rule set is live: a planted unused import and an undefined name fail it."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\n\ndef f():\n    return undefined_name\n")
    r = subprocess.run([*_ruff(), "check", "--config", str(ROOT / "pyproject.toml"), "--output-format",
                        "concise", str(bad)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "F401" in r.stdout and "F821" in r.stdout, r.stdout


def test_ruff_catches_a_long_line(tmp_path):
    """E501 is live: a line past pyproject.toml's line-length fails it."""
    bad = tmp_path / "long.py"
    bad.write_text("x = " + repr("y" * 130) + "\n")
    r = subprocess.run([*_ruff(), "check", "--config", str(ROOT / "pyproject.toml"), "--output-format",
                        "concise", str(bad)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "E501" in r.stdout, r.stdout
