"""On the GPU machine: take one part made by ``tools/gpu/stage.py``; after the last, install.

    python3 tools/gpu/install.py .gpu/part1     # "part 1/3 stored (...); still missing: part 2, 3"
    python3 tools/gpu/install.py .gpu/part2
    python3 tools/gpu/install.py .gpu/part3     # "installed vLLM 0.33.0 into /root/pcpviz-gpu/site"
    source /root/pcpviz-gpu/env.sh

Standard library only (it runs before anything is installed). Every chunk is checked against the
manifest's sha256 before it is kept, and every reassembled file again; a mismatch is one line and
exit 2. Parts may come in any order; running a part twice is harmless. ``PCPVIZ_GPU_HOME``
(default ``/root/pcpviz-gpu``) is where chunks and the install live.

The install: vLLM's Python tree and its two compiled libraries into ``site/``, the wheels with
``pip install --no-index --no-deps --target site/``, and a ``pcpviz`` dist-info whose
``vllm.general_plugins`` entry point vLLM finds (pcpviz itself is imported from this repository,
which ``env.sh`` puts on ``PYTHONPATH``).

The extras (``stage.py --extras``, parts ``extraN``, after the main parts): each library at its place in
vLLM's tree, the wheels with pip (``<wheel>.xz`` decompressed first) into ``site/`` too, ``env.sh`` again
(the CuTe DSL's package folder on ``PYTHONPATH``), then the manifest's import probe.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HOME = Path(os.environ.get("PCPVIZ_GPU_HOME", "/root/pcpviz-gpu"))
SO_TARGETS = {"_C_stable_libtorch.abi3.so.xz": "vllm/_C_stable_libtorch.abi3.so",
              "_vllm_fa3_C.abi3.so.xz": "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"}

# Where the CuTe DSL's wheels put the ``cutlass`` package (``stage.py --extras``).
CUTE_DSL_PACKAGES = "nvidia_cutlass_dsl/dsl_packages"
# Every setting below is explained in docs/gpu.md.
ENV = {
    "VLLM_USE_FLASHINFER_SAMPLER": "0",  # no FlashInfer on the image; use vLLM's own sampler kernels
    "VLLM_USE_V2_MODEL_RUNNER": "1",  # PCP exists only in the V2 model runner
    "NCCL_NVLS_ENABLE": "0",  # this workplace: no NVLink multicast (it can take shared GPUs down)
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "HF_HUB_OFFLINE": "1",  # nothing outside the machine can be reached
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
# DeepGEMM (the DSA indexer's kernels) compiles at run time with nvcc >= 12.9, found through
# DG_JIT_NVCC_COMPILER, CUDA_HOME, CUDA_PATH, PATH or /usr/local/cuda (docs/gpu.md): name the toolkit of
# the nvcc on PATH where CUDA_HOME is not set, so that DeepGEMM, the CuTe DSL and torch agree on it.
CUDA_HOME_LINES = ['if [ -z "${CUDA_HOME:-}" ] && command -v nvcc >/dev/null 2>&1; then',
                   '    export CUDA_HOME="$(dirname "$(dirname "$(command -v nvcc)")")"',
                   'fi']


def _die(msg: str) -> None:
    print(f"install.py: {msg}", file=sys.stderr)
    sys.exit(2)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def store(part: Path) -> dict:
    """Check this part's chunks and keep them under HOME/chunks; returns the manifest."""
    mf = part / "manifest.json"
    if not mf.is_file():
        _die(f"{part}: no manifest.json (is this a part made by tools/gpu/stage.py?)")
    manifest = json.loads(mf.read_text())
    chunks = _root(manifest) / "chunks"
    chunks.mkdir(parents=True, exist_ok=True)
    (_root(manifest) / "manifest.json").write_text(json.dumps(manifest))
    for name, entry in manifest["files"].items():
        for c in entry["chunks"]:
            src = part / c["name"]
            if not src.exists():
                continue
            if sha256(src) != c["sha256"]:
                _die(f"{src}: sha256 differs from the manifest (a damaged transfer: send the part again)")
            shutil.copyfile(src, chunks / c["name"])
    return manifest


def _root(manifest: dict) -> Path:
    """Where a manifest's chunks are kept: the extras (``stage.py --extras``) apart from the main parts."""
    return HOME / "extras" if manifest.get("extras") else HOME


def missing_parts(manifest: dict) -> list[int]:
    have = {p.name for p in (_root(manifest) / "chunks").iterdir()}
    return sorted({c["part"] for e in manifest["files"].values() for c in e["chunks"] if c["name"] not in have})


def _assemble(name: str, entry: dict, dest: Path, root: Path = HOME) -> Path:
    out = dest / name
    with out.open("wb") as fo:
        for c in entry["chunks"]:
            with (root / "chunks" / c["name"]).open("rb") as fi:
                shutil.copyfileobj(fi, fo, 1 << 22)
    if sha256(out) != entry["sha256"]:
        _die(f"{name}: reassembled file's sha256 differs from the manifest")
    return out


def _write_dist_info(site: Path) -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    d = site / f"pcpviz-{project['version']}.dist-info"
    d.mkdir(exist_ok=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: pcpviz\nVersion: {project['version']}\n")
    lines = []
    for group, eps in project.get("entry-points", {}).items():
        lines.append(f"[{group}]")
        lines += [f"{k} = {v}" for k, v in eps.items()]
    (d / "entry_points.txt").write_text("\n".join(lines) + "\n")
    (d / "RECORD").write_text("")


def python_path() -> str:
    """The install, the CuTe DSL's package folder (``cutlass``: its wheel adds it with a ``.pth`` file, which
    Python reads only in site-packages, not in a ``--target`` folder on PYTHONPATH), the repository."""
    site = HOME / "site"
    return f"{site}:{site / CUTE_DSL_PACKAGES}:{REPO}:{REPO / 'kernels'}"


def env_lines() -> list[str]:
    return ([f"export PYTHONPATH={python_path()}${{PYTHONPATH:+:$PYTHONPATH}}"]
            + [f"export {k}={v}" for k, v in ENV.items()] + CUDA_HOME_LINES)


def install(manifest: dict) -> None:
    site = HOME / "site"
    if site.exists():
        shutil.rmtree(site)
    site.mkdir(parents=True)
    build = HOME / "build"
    build.mkdir(exist_ok=True)
    wheels = []
    for name, entry in manifest["files"].items():
        path = _assemble(name, entry, build)
        if name == "vllm-py.tar.xz":
            with tarfile.open(path) as tar:
                tar.extractall(site, filter="data")
        elif name in SO_TARGETS:
            target = site / SO_TARGETS[name]
            target.parent.mkdir(parents=True, exist_ok=True)
            with lzma.open(path) as fi, target.open("wb") as fo:
                shutil.copyfileobj(fi, fo, 1 << 22)
            target.chmod(0o755)
        elif name.endswith(".whl"):
            wheels.append(str(path))
    _pip_install(wheels, site)
    _write_dist_info(site)
    (HOME / "env.sh").write_text("\n".join(env_lines()) + "\n")
    shutil.rmtree(build)
    probe = "import torch, vllm._C_stable_libtorch, vllm; print(vllm.__version__)"
    check = subprocess.run([sys.executable, "-c", probe],
                           env={**os.environ, "PYTHONPATH": f"{site}:{REPO}"}, capture_output=True, text=True)
    if check.returncode != 0:
        _die("vLLM does not import after the install: " + (check.stderr.strip().splitlines() or ["?"])[-1])
    print(f"installed vLLM {check.stdout.strip()} into {site}; now: source {HOME / 'env.sh'}")


def _pip_install(wheels: list[str], site: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                          "--no-cache-dir", "--target", str(site), *wheels], capture_output=True, text=True)
    if res.returncode != 0:
        _die("pip install of the wheels failed: " + (res.stderr.strip().splitlines() or ["?"])[-1])


def _merge(src: Path, site: Path) -> None:
    """Move what pip put in ``src`` into ``site``: each top-level entry replaces its namesake (a second run
    replaces the first's), but ``bin/`` is merged file by file (the main wheels' scripts stay). pip's own
    ``--target`` into a folder that has them would skip (or, with ``--upgrade``, replace) whole folders."""
    for entry in src.iterdir():
        dst = site / entry.name
        if entry.name == "bin" and entry.is_dir() and dst.is_dir():
            _merge(entry, dst)
            continue
        if dst.is_dir() and not dst.is_symlink():
            shutil.rmtree(dst)
        elif dst.exists() or dst.is_symlink():
            dst.unlink()
        shutil.move(str(entry), str(dst))


def _wheel(path: Path) -> Path:
    """A wheel as pip takes it: a ``<wheel>.xz`` (``stage.py``'s re-packed large wheel) decompressed beside it."""
    if path.name.endswith(".whl.xz"):
        out = path.with_name(path.name[:-3])
        with lzma.open(path) as fi, out.open("wb") as fo:
            shutil.copyfileobj(fi, fo, 1 << 22)
        path.unlink()
        return out
    return path


def install_extras(manifest: dict) -> None:
    """The extras (``stage.py --extras``) into an existing install: each library at its place in vLLM's
    tree, the wheels with pip; then ``env.sh`` again (the CuTe DSL's folder on PYTHONPATH) and the probe."""
    site = HOME / "site"
    if not site.is_dir():
        _die("the extras go into an existing install: install the main parts first")
    build = HOME / "extras" / "build"
    build.mkdir(exist_ok=True)
    wheels = []
    for name, entry in manifest["files"].items():
        path = _assemble(name, entry, build, HOME / "extras")
        if name in manifest["targets"]:
            target = site / manifest["targets"][name]
            target.parent.mkdir(parents=True, exist_ok=True)
            with lzma.open(path) as fi, target.open("wb") as fo:
                shutil.copyfileobj(fi, fo, 1 << 22)
            target.chmod(0o755)
        elif name.endswith((".whl", ".whl.xz")):
            wheels.append(str(_wheel(path)))
    if wheels:
        target = build / "target"
        _pip_install(wheels, target)
        _merge(target, site)
    (HOME / "env.sh").write_text("\n".join(env_lines()) + "\n")
    shutil.rmtree(build)
    installed = list(manifest["targets"].values()) + [Path(w).name.split("-")[0] for w in wheels]
    if manifest.get("probe"):
        check = subprocess.run([sys.executable, "-c", manifest["probe"]],
                               env={**os.environ, "PYTHONPATH": python_path()}, capture_output=True, text=True)
        if check.returncode != 0:
            _die("the extras do not import: " + (check.stderr.strip().splitlines() or ["?"])[-1])
    print("installed the extras: " + ", ".join(installed) + f"; now: source {HOME / 'env.sh'}")
    nvcc = find_nvcc()
    print(f"DeepGEMM's JIT compiler: {nvcc}" if nvcc else
          "install.py: warning: no nvcc found (DG_JIT_NVCC_COMPILER, $CUDA_HOME/bin, $CUDA_PATH/bin, PATH, "
          "/usr/local/cuda/bin): DeepGEMM cannot compile the indexer's kernels")


def find_nvcc() -> str | None:
    """The nvcc DeepGEMM's JIT would find, looked for in its order (docs/gpu.md), or None."""
    env = os.environ
    for cand in (env.get("DG_JIT_NVCC_COMPILER"), env.get("CUDA_HOME") and f"{env['CUDA_HOME']}/bin/nvcc",
                 env.get("CUDA_PATH") and f"{env['CUDA_PATH']}/bin/nvcc", shutil.which("nvcc"),
                 "/usr/local/cuda/bin/nvcc"):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        _die("usage: python3 tools/gpu/install.py .gpu/partN")
    part = Path(argv[0])
    if not part.is_dir():
        _die(f"{part}: not a directory")
    manifest = store(part)
    missing = missing_parts(manifest)
    name = "extra" if manifest.get("extras") else "part"
    if missing:
        print(f"{part} stored in {_root(manifest)}; still missing: " + ", ".join(f"{name}{i}" for i in missing))
        return 0
    if manifest.get("extras"):
        install_extras(manifest)
    else:
        install(manifest)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
