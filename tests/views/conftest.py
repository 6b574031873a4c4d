"""Fixtures shared by the browser tests of tests/views."""

from __future__ import annotations

import pytest

from test_browser import CHROME_ARGS, _chromium  # tests/views is on sys.path (rootless test dirs)


@pytest.fixture(scope="module")
def browser():
    """Debian's Chromium under Playwright, one per test module (the pixel tests draw in it)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=_chromium(), args=CHROME_ARGS, timeout=60_000)
        try:
            yield b
        finally:
            b.close()
