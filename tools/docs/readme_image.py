"""Make docs/img/workbench.png, the README's picture: what a 1400 x 900 screen shows of the Workbench.

``tests/views/test_browser_fit.py`` runs 00_quickstart in JupyterLab in Chromium at 1400 x 900,
scrolls the Workbench to the top of the notebook panel (the real vLLM trace of 2 x H200, PCP=2,
K=2), checks that the controls, the token order and the block tables are all on that screen, and
saves it to ``artifacts/browser/fit_1400x900.png``. This script copies that screenshot, unscaled::

    pytest tests/views/test_browser_fit.py
    python tools/docs/readme_image.py [ARTIFACTS_DIR]

Needs Pillow (the browser tests' own dependency).
"""

from __future__ import annotations

import sys
from pathlib import Path

from PIL import Image

REPO = Path(__file__).resolve().parents[2]
SHOT = "fit_1400x900.png"
SCREEN = (1400, 900)
OUT = REPO / "docs" / "img" / "workbench.png"


def main(argv: list[str]) -> int:
    shots = Path(argv[0]) if argv else REPO / "artifacts" / "browser"
    path = shots / SHOT
    if not path.is_file():
        raise SystemExit(f"readme_image: {path}: missing (run tests/views/test_browser_fit.py first)")
    img = Image.open(path).convert("RGB")
    if img.size != SCREEN:
        raise SystemExit(f"readme_image: {path}: {img.width}x{img.height}, not the 1400x900 screen")
    img = img.quantize(colors=128, method=Image.Quantize.MEDIANCUT)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    img.save(OUT, optimize=True)
    print(f"{OUT.relative_to(REPO)}: {img.width}x{img.height}, {OUT.stat().st_size // 1024} KB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
