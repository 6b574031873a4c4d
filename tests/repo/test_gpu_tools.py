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
    monkeypatch.setattr(stage, "EXTRAS_PROBE", "")
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
    monkeypatch.setattr(stage, "EXTRAS_PROBE", "")
    stage.write_parts(stage.plan_parts([lib], 10_000), tmp_path / "out", prefix="extra", extras=True)
    res = subprocess.run([sys.executable, str(TOOLS / "install.py"), str(tmp_path / "out" / "extra1")],
                         env={"PCPVIZ_GPU_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "install the main parts first" in res.stderr


def _wheel(path: Path, name: str, files: dict[str, bytes], scripts: dict[str, str] | None = None) -> Path:
    """A minimal wheel pip installs offline: ``files`` (archive name -> bytes), console ``scripts``."""
    import zipfile

    info = f"{name}-1.0.dist-info"
    members = dict(files)
    members[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode()
    members[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    if scripts:
        members[f"{info}/entry_points.txt"] = ("[console_scripts]\n" + "".join(
            f"{k} = {v}\n" for k, v in scripts.items())).encode()
    members[f"{info}/RECORD"] = "".join(f"{m},,\n" for m in [*members, f"{info}/RECORD"]).encode()
    whl = path / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w", zipfile.ZIP_DEFLATED) as zf:
        for m, data in members.items():
            zf.writestr(m, data)
    return whl


def test_a_wheel_larger_than_a_part_is_cut_and_leaves_no_empty_part(tmp_path, monkeypatch):
    stage = _load("stage", monkeypatch, tmp_path / "home")
    files = []
    sizes = (("a.so.xz", 600_000), ("big-1.0-py3-none-any.whl", 2_300_000), ("c-1.0-py3-none-any.whl", 500_000))
    for name, size in sizes:
        files.append(tmp_path / name)
        files[-1].write_bytes(b"x" * size)
    plan = stage.plan_parts(files, 1_000_000)
    assert all(plan) and all(sum(n for _, _, n in part) <= 1_000_000 for part in plan)
    assert sum(n for part in plan for _, _, n in part) == 3_400_000 and len(plan) == 4
    # a.so.xz + big[0:0.4M], big[0.4:1.4M], big[1.4:2.3M] (0.1M left: c does not fit there and is not cut), c
    assert [[f.name[0] for f, _, _ in part] for part in plan] == [["a", "b"], ["b"], ["b"], ["c"]]


def test_extra_wheels_install_beside_vllm_and_are_importable_with_env_sh(tmp_path, monkeypatch):
    """The extras' wheels (one as is, one re-packed ``<wheel>.xz``) go into the install with pip, the
    CuTe DSL's package folder is on env.sh's PYTHONPATH (its ``.pth`` is not read there), the main
    wheels' scripts in ``bin/`` stay, the manifest's probe runs, and a second run replaces the first."""
    import lzma
    import zipfile

    stage = _load("stage", monkeypatch, tmp_path / "home")
    src = tmp_path / "src"
    src.mkdir()
    lib = src / "_moe_C_stable_libtorch.abi3.so.xz"
    lib.write_bytes(lzma.compress(b"lib" * 1000))
    dsl = _wheel(src, "fake_cutlass_dsl", {"nvidia_cutlass_dsl/dsl_packages/fakecute/__init__.py": b"X = 1\n",
                                            "fake_cutlass_dsl.pth": b"import nothing_here\n"},
                 scripts={"run-fake": "fakecute:main"})
    quack = _wheel(src, "fakequack", {"fakequack/__init__.py": b"import fakecute\nY = fakecute.X + 1\n"})
    packed = stage.repack_wheel(dsl, src / (dsl.name + ".xz"))
    with zipfile.ZipFile(lzma.open(packed)) as zf:  # the re-packed wheel: same members, stored
        assert {i.compress_type for i in zf.infolist()} == {zipfile.ZIP_STORED}
        assert zf.read("nvidia_cutlass_dsl/dsl_packages/fakecute/__init__.py") == b"X = 1\n"
    monkeypatch.setattr(stage, "EXTRAS", {"vllm/_moe_C_stable_libtorch.abi3.so": 6})
    monkeypatch.setattr(stage, "EXTRAS_PROBE", "import fakecute, fakequack; assert fakequack.Y == 2")
    manifest = stage.write_parts(stage.plan_parts([lib, packed, quack], 10_000_000), tmp_path / "out",
                                 prefix="extra", extras=True)
    home = tmp_path / "home"
    (home / "site" / "bin").mkdir(parents=True)
    (home / "site" / "bin" / "uvicorn").write_text("main wheels' script")
    env = {"PCPVIZ_GPU_HOME": str(home), "PATH": "/usr/bin:/bin"}
    run = [sys.executable, str(TOOLS / "install.py"), str(tmp_path / "out" / "extra1")]
    for _ in range(2):
        done = subprocess.run(run, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    assert manifest["probe"] and "fake_cutlass_dsl" in done.stdout and "fakequack" in done.stdout
    site = home / "site"
    assert (site / "bin" / "uvicorn").read_text() == "main wheels' script" and (site / "bin" / "run-fake").exists()
    assert (site / "vllm" / "_moe_C_stable_libtorch.abi3.so").read_bytes() == b"lib" * 1000
    env_sh = (home / "env.sh").read_text()
    assert f"{site}:{site / 'nvidia_cutlass_dsl' / 'dsl_packages'}:" in env_sh and "CUDA_HOME" in env_sh
    res = subprocess.run(["bash", "-c", f"source {home / 'env.sh'} && {sys.executable} -c 'import fakequack'"],
                         capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr
    monkeypatch.setattr(stage, "EXTRAS_PROBE", "import not_installed_anywhere")
    stage.write_parts(stage.plan_parts([lib, quack], 10_000_000), tmp_path / "out2", prefix="extra", extras=True)
    bad = subprocess.run([sys.executable, str(TOOLS / "install.py"), str(tmp_path / "out2" / "extra1")],
                         env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "not_installed_anywhere" in bad.stderr
