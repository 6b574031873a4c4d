"""tools/gpu: the parts stage.py cuts are reassembled byte for byte by install.py, in any order,
and a damaged chunk is refused with one line (exit 2) and not kept."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools" / "gpu"


def _load(name, monkeypatch, home):
    monkeypatch.setenv("PCPVIZ_GPU_HOME", str(home))
    monkeypatch.syspath_prepend(str(TOOLS))
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def parts(tmp_path, monkeypatch):
    stage = _load("stage", monkeypatch, tmp_path / "home")
    rng = __import__("random").Random(7)
    files = []
    for name, size in (("big.so.xz", 2_500_000), ("tree.tar.xz", 700_000), ("a-1.0-py3-none-any.whl", 90_000),
                       ("b-2.0-py3-none-any.whl", 400_000)):
        p = tmp_path / "src" / name
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(rng.randbytes(size))
        files.append(p)
    plan = stage.plan_parts(files, 1_000_000)
    manifest = stage.write_parts(plan, tmp_path / "out")
    return tmp_path, files, plan, manifest


def test_parts_respect_the_size_and_never_cut_a_wheel(parts):
    tmp, files, plan, manifest = parts
    for chunks in plan:
        assert sum(n for _, _, n in chunks) <= 1_000_000
    for name, entry in manifest["files"].items():
        if name.endswith(".whl"):
            assert len(entry["chunks"]) == 1
    assert len(manifest["files"]["big.so.xz"]["chunks"]) >= 3


def test_install_reassembles_in_any_order(parts, monkeypatch):
    tmp, files, plan, manifest = parts
    install = _load("install", monkeypatch, tmp / "home")
    order = list(range(1, manifest["parts"] + 1))[::-1]
    for i in order[:-1]:
        install.store(tmp / "out" / f"part{i}")
        assert install.missing_parts(manifest)
    install.store(tmp / "out" / f"part{order[-1]}")
    assert install.missing_parts(manifest) == []
    build = tmp / "build"
    build.mkdir()
    for f in files:
        out = install._assemble(f.name, manifest["files"][f.name], build)
        assert out.read_bytes() == f.read_bytes()


def test_a_damaged_chunk_is_one_line_and_exit_2(parts):
    tmp, files, plan, manifest = parts
    chunk = next((tmp / "out" / "part1").glob("big.so.xz.*"))
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0xFF
    chunk.write_bytes(bytes(data))
    res = subprocess.run([sys.executable, str(TOOLS / "install.py"), str(tmp / "out" / "part1")],
                         capture_output=True, text=True,
                         env={"PCPVIZ_GPU_HOME": str(tmp / "home2"), "PATH": "/usr/bin"})
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1 and "sha256" in res.stderr
    assert not (tmp / "home2" / "chunks" / chunk.name).exists()


def test_jobs_are_listed():
    res = subprocess.run([sys.executable, str(TOOLS / "jobs.py"), "--list"], capture_output=True, text=True)
    jobs = res.stdout.split()
    assert res.returncode == 0
    assert {"trace-k1", "trace-k2", "trace-k3", "trace-chunked", "trace-piecewise", "serve", "bench", "engine",
            "piecewise-address-check", "full-graphs"} <= set(jobs)


def test_full_graphs_job_runs_vllm_unrecorded_in_the_asked_mode():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_jobs", TOOLS / "jobs.py")
    jobs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(jobs)
    job = jobs.unrecorded_job(["a"], "FULL_DECODE_ONLY")
    llm = job["llm"]
    assert llm["compilation_config"] == {"cudagraph_mode": "FULL_DECODE_ONLY"} and not llm["enforce_eager"]
    assert llm["prefill_context_parallel_size"] == 2 and llm["speculative_config"]["num_speculative_tokens"] == 2
    assert jobs.unrecorded_job(["a"], "NONE")["llm"]["enforce_eager"] and "full-graphs" in jobs.JOBS


def test_extras_go_into_an_existing_install_and_keep_the_main_manifest(tmp_path, monkeypatch):
    """``stage.py --extras`` parts (their own manifest, ``extraN``) are decompressed into their places in
    the installed tree; the main parts' manifest is left alone; without an install, one line, exit 2."""
    import lzma

    stage = _load("stage", monkeypatch, tmp_path / "home")
    lib = tmp_path / "src" / "_moe_C_stable_libtorch.abi3.so.xz"
    lib.parent.mkdir()
    payload = __import__("random").Random(3).randbytes(500_000)  # incompressible: more than one part
    lib.write_bytes(lzma.compress(payload))
    monkeypatch.setattr(stage, "EXTRAS", {"vllm/_moe_C_stable_libtorch.abi3.so": 6})
    manifest = stage.write_parts(stage.plan_parts([lib], 200_000), tmp_path / "out", prefix="extra", extras=True)
    assert manifest["extras"] and manifest["parts"] >= 2
    env = {"PCPVIZ_GPU_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"}
    run = [sys.executable, str(TOOLS / "install.py")]
    refused = subprocess.run(run + [str(tmp_path / "out" / "extra1")], env=env, capture_output=True, text=True)
    for i in range(2, manifest["parts"] + 1):
        subprocess.run(run + [str(tmp_path / "out" / f"extra{i}")], env=env, capture_output=True, text=True)
    assert refused.returncode == 0  # the first part is only stored
    (tmp_path / "home" / "site").mkdir(parents=True)
    (tmp_path / "home" / "manifest.json").write_text('{"main": true}')
    done = subprocess.run(run + [str(tmp_path / "out" / "extra1")], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "home" / "site" / "vllm" / "_moe_C_stable_libtorch.abi3.so").read_bytes() == payload
    assert (tmp_path / "home" / "manifest.json").read_text() == '{"main": true}'


def test_extras_without_an_install_are_one_line(tmp_path, monkeypatch):
    import lzma

    stage = _load("stage", monkeypatch, tmp_path / "home")
    lib = tmp_path / "x.so.xz"
    lib.write_bytes(lzma.compress(b"x" * 1000))
    monkeypatch.setattr(stage, "EXTRAS", {"vllm/x.so": 6})
    stage.write_parts(stage.plan_parts([lib], 10_000), tmp_path / "out", prefix="extra", extras=True)
    res = subprocess.run([sys.executable, str(TOOLS / "install.py"), str(tmp_path / "out" / "extra1")],
                         env={"PCPVIZ_GPU_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "install the main parts first" in res.stderr
