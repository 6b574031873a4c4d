"""run.json is read through one type (issue 40): what reads a trace (analysis, views, teaching, the
command line) asks ``Trace.run_meta`` (``pcpviz.trace.meta_model.RunMeta``) for a key's value,
never the raw document by a string key (``trace.meta["pcp"]``, ``meta.get("block_size")``), so
each fact about run.json has one decoding, one type and one default."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
READERS = ("analysis", "views", "teaching", "cli")
RAW = re.compile(r"""\.meta\s*\[|\.meta\.get\(|\bmeta\.get\(\s*["']|\bmeta\s*\[\s*["']""")


def test_readers_do_not_read_run_json_by_string_key():
    found = []
    for pkg in READERS:
        for path in sorted((ROOT / "pcpviz" / pkg).rglob("*.py")):
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if RAW.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "read run.json through Trace.run_meta (RunMeta attributes):\n" + "\n".join(found)
