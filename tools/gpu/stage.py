"""Prepare what a bare GPU machine lacks for real vLLM 0.33.0, in parts small enough to send.

    python tools/gpu/stage.py                  # -> .gpu/part1 .gpu/part2 .gpu/part3 (+ manifest)
    python tools/gpu/stage.py --part-mb 17     # smaller parts (more of them): the repository is 48 MB
    python tools/gpu/stage.py --extras         # the MoE + DSA model's libraries and wheels (.gpu/extraN)

Run here (CPU, any Python); then, on the GPU machine, in the repository root, one part per
command, back to back (a bare machine keeps /root only while it stays warm):

    python3 tools/gpu/install.py .gpu/part1    # each part: checked (sha256) and unpacked
    python3 tools/gpu/install.py .gpu/part2
    python3 tools/gpu/install.py .gpu/part3    # the last part completes the install
    source /root/pcpviz-gpu/env.sh              # PYTHONPATH and the settings docs/gpu.md explains

What goes into the parts (from the vllm 0.33.0 wheel and ``tools/gpu/wheels.txt``):

* ``vllm-py.tar.xz``: vLLM's Python tree without the large compiled libraries this model does not
  load (fa2, the MoE kernels, deep_gemm, ``vllm-rs``, FlashKDA); ``third_party/pynvml.py`` stays
  (platform detection needs it);
* ``_C_stable_libtorch.abi3.so`` (xz -9) and ``vllm_flash_attn/_vllm_fa3_C.abi3.so`` (xz -6): the
  custom ops (RMSNorm, rotary, cache writes, ...) and FlashAttention 3 for MLA; vLLM 0.33.0 builds
  them against torch's stable ABI, so they load on the GPU image's torch 2.11;
* the light wheels of ``tools/gpu/wheels.txt`` (CPython 3.12, x86-64, no dependencies: closed list).

``--extras`` (after the main parts, ``install.py .gpu/extraN``): the fused MoE's ops and DeepGEMM from
the same wheel, and the wheels of ``tools/gpu/wheels-extras.txt`` (the CuTe DSL, ``import cutlass``, and
QuACK); a wheel over ``REPACK_BYTES`` is re-written uncompressed and xz'd (``<wheel>.xz``).

Large files are cut into chunks so that no part exceeds ``--part-mb`` (the device tool sends at
most 64 MiB a command, the repository included: stage.py says which part size fits when the
repository has grown past the default's room). ``manifest.json`` (in every part) lists each
file's chunks and sha256; ``install.py`` refuses a part whose chunk does not match.
"""

from __future__ import annotations

import argparse
import json
import lzma
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from install import sha256  # tools/gpu/install.py (this script's folder is on sys.path)

REPO = Path(__file__).resolve().parents[2]
VLLM_VERSION = "0.33.0"
# Compiled files kept out of the Python tree: sent separately (first two) or not needed by the
# shipped model (MLA dense, bf16, FLASH_ATTN_MLA backend).
SEPARATE = {"vllm/_C_stable_libtorch.abi3.so": 9, "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so": 6}
LEFT_OUT = ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/_moe_C_stable_libtorch.abi3.so",
            "vllm/third_party/deep_gemm/_C_extension.abi3.so", "vllm/vllm-rs", "vllm/_flashkda_C.abi3.so")
# ``--extras``: the compiled libraries the MoE + DSA model needs beyond the dense model's (the fused MoE's
# custom ops; DeepGEMM, which vLLM's sparse-attention indexer requires on CUDA,
# ``sparse_attn_indexer.py:1060-1064``), sent as parts of their own after the main ones, with the wheels
# of ``tools/gpu/wheels-extras.txt`` (the CuTe DSL, ``import cutlass``, and QuACK).
EXTRAS = {"vllm/_moe_C_stable_libtorch.abi3.so": 6, "vllm/third_party/deep_gemm/_C_extension.abi3.so": 6}
EXTRA_WHEELS = "wheels-extras.txt"
# An extra wheel larger than this is re-packed (``repack_wheel``): the CuTe DSL's cu13 libraries (92 MB).
REPACK_BYTES = 20_000_000
# What install.py imports, after the extras, to check them (the module whose ``import cutlass`` failed on
# the GPU machine, the router GEMM's QuACK helper, DeepGEMM with its headers); one line and exit 2 if it fails.
EXTRAS_PROBE = ("import cutlass, cutlass.cute, quack.compile_utils; "
                "import vllm.models.deepseek_v32.nvidia.ops.fused_q_cutedsl, vllm.third_party.deep_gemm")
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64", "manylinux_2_26_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_28_x86_64", "manylinux_2_31_x86_64", "any")


TRANSFER_BYTES = 64 << 20  # what one device command carries: the repository and one part


def repo_bytes() -> int:
    """Bytes of the files a device command carries besides the part (git's tracked files)."""
    res = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True)
    names = [n for n in res.stdout.decode("utf-8", "replace").split("\0") if n] if res.returncode == 0 else []
    return sum((REPO / n).stat().st_size for n in names if (REPO / n).is_file())


def _pip_download(args: list[str], dest: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--abi", "abi3",
           "--abi", "none", *[a for p in PLATFORMS for a in ("--platform", p)], "-d", str(dest), *args]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        err = [ln for ln in res.stderr.splitlines() if ln.startswith("ERROR")] or res.stderr.splitlines()[-1:]
        sys.exit(f"stage.py: pip download {' '.join(args)} failed: {err[0] if err else res.returncode}")


def _wheel_pins(listing: str = "wheels.txt") -> list[str]:
    lines = (REPO / "tools" / "gpu" / listing).read_text().splitlines()
    return [ln.split("#")[0].strip() for ln in lines if ln.split("#")[0].strip()]


def _download_pins(listing: str, wheels: Path) -> list[Path]:
    """The wheels of ``tools/gpu/<listing>`` (downloaded into ``wheels`` once), one per pin."""
    wheels.mkdir(parents=True, exist_ok=True)
    out = []
    for pin in _wheel_pins(listing):
        name = pin.split("==")[0].lower().replace("-", "_").replace(".", "_")
        version = pin.split("==")[1]
        found = [p for p in wheels.glob("*.whl") if p.name.lower().startswith(f"{name}-{version}-")]
        if not found:
            _pip_download([pin], wheels)
            found = [p for p in wheels.glob("*.whl") if p.name.lower().startswith(f"{name}-{version}-")]
        if len(found) != 1:
            sys.exit(f"stage.py: {pin}: expected one wheel in {wheels}, found {len(found)}")
        out.append(found[0])
    return out


def repack_wheel(wheel: Path, dst: Path, preset: int = 6) -> Path:
    """``wheel`` re-written uncompressed (the same members and bytes: still a valid wheel) and xz'd to
    ``dst`` (``<wheel>.xz``): a wheel's deflate leaves much that xz finds (92 -> 65 MB for the CuTe DSL's
    cu13 libraries); ``install.py`` turns it back into the ``.whl`` before ``pip install``."""
    if dst.exists():
        return dst
    print(f"stage.py: repacking {wheel.name} (uncompressed, then xz -{preset})", flush=True)
    stored = dst.with_name(wheel.name + ".stored")
    with zipfile.ZipFile(wheel) as zi, zipfile.ZipFile(stored, "w", zipfile.ZIP_STORED) as zo:
        for info in zi.infolist():
            out = zipfile.ZipInfo(info.filename, info.date_time)
            out.external_attr = info.external_attr
            out.compress_type = zipfile.ZIP_STORED
            with zi.open(info) as fi, zo.open(out, "w", force_zip64=True) as fo:
                shutil.copyfileobj(fi, fo, 1 << 22)
    _xz(stored, dst.with_suffix(".tmp"), preset)
    dst.with_suffix(".tmp").rename(dst)
    stored.unlink()
    return dst


def _xz(src: Path, dst: Path, preset: int) -> None:
    with src.open("rb") as fi, lzma.open(dst, "wb", preset=preset) as fo:
        shutil.copyfileobj(fi, fo, 1 << 22)


def build_files(work: Path, vllm_wheel: Path | None) -> list[Path]:
    """The files to send (in ``work/files``), built once and reused."""
    files = work / "files"
    files.mkdir(parents=True, exist_ok=True)
    if vllm_wheel is None:
        (work / "wheel").mkdir(exist_ok=True)
        found = sorted((work / "wheel").glob(f"vllm-{VLLM_VERSION}-*.whl"))
        if not found:
            print(f"stage.py: downloading vllm=={VLLM_VERSION} (336 MB)", flush=True)
            _pip_download([f"vllm=={VLLM_VERSION}"], work / "wheel")
            found = sorted((work / "wheel").glob(f"vllm-{VLLM_VERSION}-*.whl"))
        vllm_wheel = found[0]
    out: list[Path] = []
    tree_xz = files / "vllm-py.tar.xz"
    with zipfile.ZipFile(vllm_wheel) as zf:
        names = zf.namelist()
        if not tree_xz.exists():
            print("stage.py: packing vLLM's Python tree", flush=True)
            with tarfile.open(tree_xz.with_suffix(".tmp"), "w:xz", preset=6) as tar:
                for name in names:
                    if name in SEPARATE or name in LEFT_OUT or name.endswith("/"):
                        continue
                    info = tarfile.TarInfo(name)
                    data = zf.read(name)
                    info.size = len(data)
                    info.mode = 0o755 if name.endswith(".so") else 0o644
                    import io

                    tar.addfile(info, io.BytesIO(data))
            tree_xz.with_suffix(".tmp").rename(tree_xz)
        out.append(tree_xz)
        for name, preset in SEPARATE.items():
            dst = files / (Path(name).name + ".xz")
            if not dst.exists():
                print(f"stage.py: xz -{preset} {name}", flush=True)
                raw = work / Path(name).name
                with zf.open(name) as fi, raw.open("wb") as fo:
                    shutil.copyfileobj(fi, fo, 1 << 22)
                _xz(raw, dst.with_suffix(".tmp"), preset)
                dst.with_suffix(".tmp").rename(dst)
                raw.unlink()
            out.append(dst)
    out.extend(sorted(_download_pins("wheels.txt", work / "wheels")))
    return out


def plan_parts(files: list[Path], part_bytes: int) -> list[list[tuple[Path, int, int]]]:
    """First-fit: each part a list of ``(file, offset, length)`` chunks, at most ``part_bytes``.

    Example (part 48 MB): tree 13.7 + _C 63.7 + fa3 11.6 + wheels 32 ->
    part1 = tree + _C[0:34.3], part2 = _C[34.3:63.7] + fa3 + wheels[..], part3 = the rest."""
    parts: list[list[tuple[Path, int, int]]] = [[]]
    room = part_bytes
    for f in files:
        size, off = f.stat().st_size, 0
        while off < size:
            if room == 0:
                parts.append([])
                room = part_bytes
            small = f.suffix == ".whl"
            if small and off == 0 and room < size <= part_bytes:  # a wheel that fits in a part is never cut
                parts.append([])
                room = part_bytes
            n = min(size - off, room)
            parts[-1].append((f, off, n))
            off += n
            room -= n
    return parts


def write_parts(parts: list[list[tuple[Path, int, int]]], out: Path, *, prefix: str = "part",
                extras: bool = False) -> dict:
    for old in out.glob(f"{prefix}*") if out.exists() else []:
        shutil.rmtree(old)
    manifest: dict = {"vllm_version": VLLM_VERSION, "parts": len(parts), "files": {}, "extras": extras}
    if extras:
        manifest["targets"] = {Path(n).name + ".xz": n for n in EXTRAS}
        manifest["probe"] = EXTRAS_PROBE
    for i, chunks in enumerate(parts, 1):
        d = out / f"{prefix}{i}"
        d.mkdir(parents=True)
        for f, off, n in chunks:
            entry = manifest["files"].setdefault(f.name, {"sha256": sha256(f), "size": f.stat().st_size,
                                                          "chunks": []})
            chunk = d / f"{f.name}.{len(entry['chunks']):02d}"
            with f.open("rb") as fi, chunk.open("wb") as fo:
                fi.seek(off)
                fo.write(fi.read(n))
            entry["chunks"].append({"part": i, "name": chunk.name, "sha256": sha256(chunk)})
    for i in range(1, len(parts) + 1):
        (out / f"{prefix}{i}" / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / ".gpu", help="where the parts go (git-ignored)")
    ap.add_argument("--work", type=Path, default=REPO / ".gpu-work", help="download and build cache")
    ap.add_argument("--vllm-wheel", type=Path, default=None, help="a vllm-0.33.0 wheel already on disk")
    ap.add_argument("--part-mb", type=float, default=44.0, help="size of a part in MB (10^6 bytes)")
    ap.add_argument("--extras", action="store_true", help="only the MoE + DSA model's extra libraries, as "
                    "parts extra1, extra2, ... (install.py adds them to an existing install)")
    a = ap.parse_args(argv)
    if a.part_mb < 1:
        ap.error("--part-mb must be at least 1")
    room = TRANSFER_BYTES - repo_bytes()
    if a.part_mb * 1e6 > room:
        print(f"stage.py: note: the repository's files take {repo_bytes() / 1e6:.1f} MB of the "
              f"{TRANSFER_BYTES / 2**20:.0f} MiB a device command carries; a part of {a.part_mb:g} MB does not "
              f"fit beside them: use --part-mb {int(room / 1e6)}", file=sys.stderr)
    if a.extras:
        files = build_extras(a.work, a.vllm_wheel)
        parts = plan_parts(files, int(a.part_mb * 1e6))
        manifest = write_parts(parts, a.out, prefix="extra", extras=True)
    else:
        files = build_files(a.work, a.vllm_wheel)
        parts = plan_parts(files, int(a.part_mb * 1e6))
        manifest = write_parts(parts, a.out)
    name = "extra" if a.extras else "part"
    for i in range(1, manifest["parts"] + 1):
        size = sum(p.stat().st_size for p in (a.out / f"{name}{i}").iterdir())
        print(f"{a.out / f'{name}{i}'}: {size / 1e6:.1f} MB")
    print(f"on the GPU machine, one command per part, back to back: python3 tools/gpu/install.py .gpu/{name}N")
    return 0


def build_extras(work: Path, vllm_wheel: Path | None) -> list[Path]:
    """``EXTRAS`` out of the wheel, each xz-compressed (in ``work/extras``), then the wheels of
    ``EXTRA_WHEELS`` (those over ``REPACK_BYTES`` re-packed as ``<wheel>.xz``)."""
    wheel = vllm_wheel or sorted((work / "wheel").glob(f"vllm-{VLLM_VERSION}-*.whl"))[0]
    files = work / "extras"
    files.mkdir(parents=True, exist_ok=True)
    out = []
    with zipfile.ZipFile(wheel) as zf:
        for name, preset in EXTRAS.items():
            dst = files / (Path(name).name + ".xz")
            if not dst.exists():
                print(f"stage.py: xz -{preset} {name}", flush=True)
                with zf.open(name) as fi, lzma.open(dst.with_suffix(".tmp"), "wb", preset=preset) as fo:
                    shutil.copyfileobj(fi, fo, 1 << 22)
                dst.with_suffix(".tmp").rename(dst)
            out.append(dst)
    for wheel in _download_pins(EXTRA_WHEELS, work / "extra-wheels"):
        big = wheel.stat().st_size > REPACK_BYTES
        out.append(repack_wheel(wheel, files / (wheel.name + ".xz")) if big else wheel)
    return out


if __name__ == "__main__":
    sys.exit(main())
