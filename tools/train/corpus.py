"""Training corpus: the Python standard library's own ``*.py`` sources.

Every machine with Python has this text, so the model can be retrained anywhere. Modules are
split deterministically into ``train`` and ``heldout`` by a keyed hash of their path relative
to the stdlib root (never by content, never by position in a listing), so the same module is
held out on every machine and every Python version, and MTP acceptance can be measured on
source the model never saw.

Pure standard library (no torch / numpy), so it also runs where only ``torch`` is installed.

A corpus can be frozen into a single ``.tar.gz`` "pack" (:func:`write_pack`) so that training on
another machine (for example a GPU box with a different Python) sees byte-identical text;
:func:`corpus_hash` identifies the exact text + split either way.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import sysconfig
import tarfile
from typing import Iterable, Sequence

SPLIT_KEY = "pcpviz-corpus-split-v1"  # the split's fixed seed; changing it changes the split
HELDOUT_PERCENT = 5  # ~5% of modules are held out
EXCLUDE_DIRS = ("site-packages", "dist-packages", "__pycache__")

__all__ = [
    "SPLIT_KEY", "HELDOUT_PERCENT", "SourceFile", "Corpus", "stdlib_root", "split_of",
    "list_sources", "load_corpus", "corpus_hash", "write_pack", "read_pack",
]


@dataclasses.dataclass(frozen=True)
class SourceFile:
    path: str  # relative to the stdlib root, '/'-separated
    data: bytes

    @property
    def split(self) -> str:
        return split_of(self.path)


@dataclasses.dataclass(frozen=True)
class Corpus:
    files: tuple  # tuple[SourceFile, ...], sorted by path
    origin: str  # where the text came from (stdlib path or pack file)

    def split(self, name: str) -> list:
        """The files of split ``name`` ("train" or "heldout"), sorted by path."""
        if name not in ("train", "heldout"):
            raise ValueError(f"unknown split {name!r}")
        return [f for f in self.files if split_of(f.path) == name]

    @property
    def hash(self) -> str:
        return corpus_hash(self.files)

    def summary(self) -> dict:
        out = {"origin": self.origin, "split_key": SPLIT_KEY, "heldout_percent": HELDOUT_PERCENT,
               "corpus_hash": self.hash}
        for name in ("train", "heldout"):
            fs = self.split(name)
            out[name] = {"files": len(fs), "bytes": sum(len(f.data) for f in fs)}
        return out


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def split_of(relpath: str) -> str:
    """'train' or 'heldout' for a module path relative to the stdlib root (deterministic)."""
    rel = relpath.replace(os.sep, "/")
    digest = hashlib.sha256(f"{SPLIT_KEY}\0{rel}".encode("utf-8")).digest()
    bucket = int.from_bytes(digest[:8], "big") % 100
    return "heldout" if bucket < HELDOUT_PERCENT else "train"


def list_sources(root: str | None = None) -> list[str]:
    """Sorted relative paths of the ``*.py`` files under the stdlib root (no site-packages)."""
    root = root or stdlib_root()
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDE_DIRS)
        for fn in filenames:
            if fn.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, fn), root).replace(os.sep, "/")
                found.append(rel)
    return sorted(found)


def load_corpus(root: str | None = None, pack: str | None = None) -> Corpus:
    """Load the corpus from a pack file if given, else from the stdlib root."""
    if pack:
        return read_pack(pack)
    root = root or stdlib_root()
    files = []
    for rel in list_sources(root):
        with open(os.path.join(root, rel), "rb") as f:
            files.append(SourceFile(rel, f.read()))
    return Corpus(tuple(files), origin=os.path.abspath(root))


def corpus_hash(files: Iterable[SourceFile]) -> str:
    """sha256 over (split, path, sha256(content)) of every file, in path order."""
    h = hashlib.sha256(SPLIT_KEY.encode("utf-8"))
    for f in sorted(files, key=lambda f: f.path):
        line = f"{split_of(f.path)}\t{f.path}\t{hashlib.sha256(f.data).hexdigest()}\n"
        h.update(line.encode("utf-8"))
    return h.hexdigest()


def write_pack(path: str, corpus: Corpus | None = None) -> dict:
    """Freeze a corpus into a ``.tar.gz`` (with a ``MANIFEST.json``) for training elsewhere."""
    corpus = corpus or load_corpus()
    manifest = corpus.summary()
    with tarfile.open(path, "w:gz") as tar:
        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 0
            tar.addfile(info, io.BytesIO(data))
        add("MANIFEST.json", json.dumps(manifest, indent=1).encode("utf-8"))
        for f in corpus.files:
            add("src/" + f.path, f.data)
    return manifest


def read_pack(path: str) -> Corpus:
    files = []
    with tarfile.open(path, "r:gz") as tar:
        for m in tar.getmembers():
            if m.isfile() and m.name.startswith("src/"):
                fh = tar.extractfile(m)
                assert fh is not None
                files.append(SourceFile(m.name[len("src/"):], fh.read()))
    files.sort(key=lambda f: f.path)
    return Corpus(tuple(files), origin=os.path.abspath(path))


def concat_tokens(files: Sequence[SourceFile], bos_id: int, eos_id: int) -> bytes:
    """Concatenate files as ``<bos> bytes <eos>`` documents, as a little-endian uint16 buffer."""
    import array
    import sys

    buf = array.array("H")
    for f in files:
        buf.append(bos_id)
        buf.extend(f.data)
        buf.append(eos_id)
    if buf.itemsize != 2:
        raise RuntimeError("unexpected uint16 size")
    if sys.byteorder != "little":
        buf.byteswap()
    return buf.tobytes()


def _main(argv=None) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m tools.train.corpus",
                                description="Summarize the stdlib corpus, or freeze it into a pack.")
    p.add_argument("--pack", default=None, help="write the corpus to this .tar.gz")
    p.add_argument("--root", default=None, help="stdlib root (default: this interpreter's)")
    args = p.parse_args(argv)
    c = load_corpus(root=args.root)
    if args.pack:
        write_pack(args.pack, c)
    print(json.dumps(c.summary(), indent=1))


if __name__ == "__main__":
    _main()
