"""Compose docs/img/workbench.png, the README's picture, from the browser view test's screenshots.

``tests/views/test_browser_views.py`` draws the Workbench's figures in Chromium and writes them to
``artifacts/views/<case>_<view>.png``. This script puts two of them side by side for the shipped
real vLLM trace (2 x H200, PCP=2, K=2) at its largest step: the token-order view (which rank
computes which token) and the block tables (global, rank-local and draft rows)::

    pytest tests/views/test_browser_views.py -k "vllm-h200x2-pcp2-mtp2 and not chunked and not piecewise"
    python tools/docs/readme_image.py [ARTIFACTS_DIR]

Needs Pillow (the browser test's own dependency).
"""

from __future__ import annotations

import sys
from pathlib import Path

from PIL import Image

REPO = Path(__file__).resolve().parents[2]
CASE = "vllm-h200x2-pcp2-mtp2_step2"
PANELS = (("token_order", 600), ("block_tables", 680))  # (view, rows of the screenshot kept)
WIDTH = 1400  # of the composed image
OUT = REPO / "docs" / "img" / "workbench.png"


def compose(shots: Path) -> Image.Image:
    tiles = []
    for view, keep in PANELS:
        path = shots / f"{CASE}_{view}.png"
        if not path.is_file():
            raise SystemExit(f"readme_image: {path}: missing (run tests/views/test_browser_views.py first)")
        img = Image.open(path).convert("RGB")
        tiles.append(img.crop((0, 0, img.width, min(keep, img.height))))
    height = max(t.height for t in tiles)
    sheet = Image.new("RGB", (sum(t.width for t in tiles), height), "white")
    x = 0
    for t in tiles:
        sheet.paste(t, (x, 0))
        x += t.width
    return sheet.resize((WIDTH, round(height * WIDTH / sheet.width)), Image.LANCZOS)


def main(argv: list[str]) -> int:
    shots = Path(argv[0]) if argv else REPO / "artifacts" / "views"
    img = compose(shots).quantize(colors=128, method=Image.Quantize.MEDIANCUT)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    img.save(OUT, optimize=True)
    print(f"{OUT.relative_to(REPO)}: {img.width}x{img.height}, {OUT.stat().st_size // 1024} KB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
