"""environment.yml's pip section must list exactly pyproject's dependencies
(+ the test extra), with the same version specifiers, so conda users and pip
users get the same packages."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _norm(req: str) -> str:
    name, spec = re.match(r"^\s*([A-Za-z0-9_.\-\[\]]+)\s*(.*)$", req).groups()
    return name.lower().replace("_", "-") + spec.replace(" ", "")


def _pip_section(text: str) -> list[str]:
    lines, inside = [], False
    for line in text.splitlines():
        if re.match(r"^\s*-\s*pip:\s*$", line):
            inside = True
            continue
        if inside:
            m = re.match(r"^\s{4,}-\s*(.+?)\s*$", line)
            if not m:
                break
            if not m.group(1).startswith("-e"):
                lines.append(m.group(1))
    return lines


def test_environment_pip_section_equals_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    expected = sorted(_norm(r) for r in project["dependencies"] + project["optional-dependencies"]["test"])
    got = sorted(_norm(r) for r in _pip_section((ROOT / "environment.yml").read_text()))
    assert got == expected, f"environment.yml pip section drifted from pyproject.toml: {set(got) ^ set(expected)}"


def test_drift_is_detected(tmp_path):
    text = (ROOT / "environment.yml").read_text().replace("plotly>=6.0", "plotly>=5.0")
    assert "plotly>=5.0" in _pip_section(text)
    assert sorted(_norm(r) for r in _pip_section(text)) != sorted(
        _norm(r) for r in _pip_section((ROOT / "environment.yml").read_text())
    )


def test_cpu_constraints_pin_torch_and_triton():
    text = (ROOT / "requirements" / "cpu-constraints.txt").read_text()
    assert re.search(r"^torch==2\.13\.0$", text, re.M) and re.search(r"^triton==\d", text, re.M)


def test_pip_check_finds_only_vllms_own_requirements_unmet():
    """vllm is installed with --no-deps (its torch 2.14 / CUDA requirements are not wanted on
    CPU); every other installed package must have what it requires."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True,
                         env={"PIP_DISABLE_PIP_VERSION_CHECK": "1", "PATH": "/usr/bin:/bin"}).stdout
    others = [line for line in out.splitlines() if line.strip() and not line.startswith("vllm ")
              and not line.startswith("No broken requirements")]
    assert not others, "\n".join(others)


def _make_n(*targets: str) -> str:
    import subprocess

    return subprocess.run(["make", "-s", "-n", "-o", "setup", "-C", str(ROOT), *targets, "VENV=/nonexistent/venv"],
                          capture_output=True, text=True, check=True).stdout


def test_make_test_installs_chromium_before_the_tests():
    """A fresh machine needs nothing done by hand: `make test` (not only .ci/run) installs
    Chromium for the browser tests, or prints the one line to run when it cannot (not root)."""
    out = _make_n("test")
    assert "apt-get install" in out and "chromium" in out
    assert "sudo apt-get install chromium" in out  # the line for a user who is not root
    assert out.index("apt-get install") < out.index("-m pytest")
    assert "apt-get" not in (ROOT / ".ci" / "run").read_text()  # one place installs it


def test_make_setup_installs_vllm_last_without_its_dependencies():
    """pip's resolver only reports vllm's unmet requirements when it resolves something vllm
    depends on with vllm already installed: vllm goes in last, with --no-deps."""
    import subprocess

    out = subprocess.run(["make", "-s", "-n", "-B", "-C", str(ROOT), "setup", "VENV=/nonexistent/venv"],
                         capture_output=True, text=True, check=True).stdout
    installs = [line for line in out.splitlines() if " install " in line]
    assert "--no-deps vllm==0.33.0" in installs[-1]
    assert all("--no-warn-conflicts" in line for line in installs[1:-1])
